// A NumPy data-memory handler (NEP 49) for the tests' fault injection
// (tests/helpers/faults.py): every array buffer NumPy allocates while it is installed goes
// through it, so that the k-th allocation can fail (NumPy then raises MemoryError, as when
// malloc returns NULL) and the bytes still allocated can be counted.
//
// Python interface (module numpy_faults):
//   install()           -> the handler that was current (for restore); installs this one in the
//                          current context (contextvar: the calling thread's)
//   restore(handler)    puts ``handler`` back
//   arm(fail_at)        counts allocations from now on (the first is 1); the fail_at-th fails
//                       (0: none fails); also starts counting the live blocks made from now on
//   retarget(k)         from now on the k-th allocation since arm fails (0: none)
//   live()              -> {data pointer: bytes} of the blocks made since arm and not freed
//   disarm()            stops counting and failing (the live blocks stay listed)
//   stats()             -> (allocations counted, whether the failure fired, live bytes and live
//                          blocks among those allocated since arm)
//
// Each block carries a 16-byte header (its size and whether it was made while armed), so that
// a free of it, whenever it comes, is accounted for.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace {

struct Header {
    size_t size;
    size_t counted;     // 1: made while armed (its free is counted)
};
static_assert(sizeof(Header) == 16, "the header keeps 16-byte alignment");

long long armed = 0, count = 0, fail_at = 0, fired = 0, live_bytes = 0, live_blocks = 0;
// the blocks made while armed and not freed yet: data pointer -> bytes
std::unordered_map<void *, size_t> *live_map = nullptr;

void *finish(void *raw, size_t size) {
    if (raw == nullptr) return nullptr;
    auto *h = static_cast<Header *>(raw);
    h->size = size;
    h->counted = armed ? 1 : 0;
    if (armed) {
        live_bytes += static_cast<long long>(size);
        live_blocks += 1;
        (*live_map)[h + 1] = size;
    }
    return h + 1;
}

bool fail_now() {
    if (!armed) return false;
    count += 1;
    if (fail_at > 0 && count == fail_at) {
        fired = 1;
        return true;
    }
    return false;
}

void forget(Header *h) {
    if (h->counted) {
        live_bytes -= static_cast<long long>(h->size);
        live_blocks -= 1;
        live_map->erase(h + 1);
    }
}

void *h_malloc(void *, size_t size) {
    if (fail_now()) return nullptr;
    return finish(std::malloc(size + sizeof(Header)), size);
}

void *h_calloc(void *, size_t n, size_t elsize) {
    if (fail_now()) return nullptr;
    size_t size = n * elsize;
    void *raw = std::calloc(1, size + sizeof(Header));
    return finish(raw, size);
}

void *h_realloc(void *, void *ptr, size_t size) {
    if (ptr == nullptr) return h_malloc(nullptr, size);
    if (fail_now()) return nullptr;
    Header *old = static_cast<Header *>(ptr) - 1;
    Header saved = *old;
    void *raw = std::realloc(old, size + sizeof(Header));
    if (raw == nullptr) return nullptr;
    auto *h = static_cast<Header *>(raw);
    if (saved.counted) {
        live_bytes += static_cast<long long>(size) - static_cast<long long>(saved.size);
        live_map->erase(ptr);
        (*live_map)[h + 1] = size;
    }
    h->size = size;
    return h + 1;
}

void h_free(void *, void *ptr, size_t) {
    if (ptr == nullptr) return;
    Header *h = static_cast<Header *>(ptr) - 1;
    forget(h);
    std::free(h);
}

PyDataMem_Handler handler = {
    "lltm_cupy_test_faults",
    1,
    {nullptr, h_malloc, h_calloc, h_realloc, h_free},
};

PyObject *capsule = nullptr;

PyObject *install(PyObject *, PyObject *) {
    return PyDataMem_SetHandler(capsule);
}

PyObject *restore(PyObject *, PyObject *arg) {
    PyObject *old = PyDataMem_SetHandler(arg);
    if (old == nullptr) return nullptr;
    Py_DECREF(old);
    Py_RETURN_NONE;
}

PyObject *arm(PyObject *, PyObject *arg) {
    long long k = PyLong_AsLongLong(arg);
    if (k == -1 && PyErr_Occurred()) return nullptr;
    count = 0;
    fired = 0;
    fail_at = k;
    live_bytes = 0;
    live_blocks = 0;
    for (auto &entry : *live_map) {     // blocks of an earlier arm: no longer counted
        static_cast<Header *>(entry.first)[-1].counted = 0;
    }
    live_map->clear();
    armed = 1;
    Py_RETURN_NONE;
}

PyObject *retarget(PyObject *, PyObject *arg) {
    long long k = PyLong_AsLongLong(arg);
    if (k == -1 && PyErr_Occurred()) return nullptr;
    fail_at = k;
    Py_RETURN_NONE;
}

PyObject *live(PyObject *, PyObject *) {
    PyObject *out = PyDict_New();
    if (out == nullptr) return nullptr;
    for (auto &entry : *live_map) {
        PyObject *key = PyLong_FromVoidPtr(entry.first);
        PyObject *value = PyLong_FromSize_t(entry.second);
        if (key == nullptr || value == nullptr || PyDict_SetItem(out, key, value) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(value);
            Py_DECREF(out);
            return nullptr;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return out;
}

PyObject *disarm(PyObject *, PyObject *) {
    armed = 0;
    Py_RETURN_NONE;
}

PyObject *stats(PyObject *, PyObject *) {
    return Py_BuildValue("(LLLL)", count, fired, live_bytes, live_blocks);
}

PyMethodDef methods[] = {
    {"install", install, METH_NOARGS, "install the handler; returns the previous one"},
    {"restore", restore, METH_O, "put a handler back"},
    {"arm", arm, METH_O, "count allocations; fail the given one (0: none)"},
    {"retarget", retarget, METH_O, "fail the given allocation from now on (0: none)"},
    {"live", live, METH_NOARGS, "{pointer: bytes} of the blocks made since arm, alive"},
    {"disarm", disarm, METH_NOARGS, "stop counting"},
    {"stats", stats, METH_NOARGS, "(count, fired, live bytes, live blocks)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "numpy_faults", nullptr, -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_numpy_faults(void) {
    import_array();
    live_map = new std::unordered_map<void *, size_t>();
    capsule = PyCapsule_New(&handler, "mem_handler", nullptr);
    if (capsule == nullptr) return nullptr;
    return PyModule_Create(&module);
}
