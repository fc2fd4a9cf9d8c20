"""Deployment (docs/deploy.md): while ``torch.export``, ``torch.onnx.export`` (both exporters) or
``torch.jit.trace`` record ``LLTMCell`` / ``LLTM``, the layer computes in torch operators, so
the recorded program replays correctly on new inputs (other batch sizes and lengths) and runs
without ``lltm_cupy``; what cannot be recorded (variable lengths, a direct backend call under
``jit.trace``) raises the library's error instead of being recorded as constants.

Every recorded program is compared with the eager layer (the NumPy backend) on inputs of sizes
other than those it was recorded with, by the suite's normalised error and float32's tolerance.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")

import lltm_cupy.torch as lt  # noqa: E402
from lltm_cupy.torch import _export  # noqa: E402
from conftest import TOLERANCE, max_error  # noqa: E402

import numpy as np  # noqa: E402

TOL = TOLERANCE[np.dtype(np.float32)]
F, S = 3, 5
SIZES = ((2, 7), (4, 2))    # (batch, steps) of the replays; recorded at (3, 5)


def _flat(out):
    """The tensors of a nested tuple, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for part in out for t in _flat(part)]


def _cell(state: bool):
    def args(batch, steps):
        x = torch.randn(batch, F)
        return (x, (torch.randn(batch, S), torch.randn(batch, S))) if state else (x,)
    return lt.LLTMCell(F, S), args, {"batch": [0], "steps": []}


def _lltm(layers=1, bidirectional=False, batch_first=False, state=False):
    count = layers * (2 if bidirectional else 1)

    def args(batch, steps):
        x = torch.randn(batch, steps, F) if batch_first else torch.randn(steps, batch, F)
        if not state:
            return (x,)
        return x, (torch.randn(count, batch, S), torch.randn(count, batch, S))
    model = lt.LLTM(F, S, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    return model, args, {"batch": [0 if batch_first else 1, 1], "steps": [1 if batch_first else 0]}


CONFIGS = {
    "cell": lambda: _cell(False),
    "cell-state": lambda: _cell(True),
    "lltm": lambda: _lltm(),
    "lltm-2-layers-bidirectional-batch-first-state": lambda: _lltm(2, True, True, True),
}


def _model(name):
    torch.manual_seed(0)
    model, args, dims = CONFIGS[name]()
    return model.eval(), args, dims


def _dynamic_shapes(args, dims, steps=True):
    """torch.export's dynamic_shapes: batch (and steps) dynamic in every input."""
    batch, time = torch.export.Dim("batch"), torch.export.Dim("steps")

    def spec(t, i):
        d = {}
        if i == 0 and steps and dims["steps"]:
            d[dims["steps"][0]] = time
        d[dims["batch"][0] if i == 0 else dims["batch"][-1]] = batch
        return d
    return tuple(spec(a, 0) if i == 0 else tuple(spec(t, 1) for t in a)
                 for i, a in enumerate(args))


def _check_replays(run, model, args, sizes=SIZES):
    """``run`` (the recorded program) equals the eager model on inputs of other sizes."""
    for batch, steps in sizes:
        new = args(batch, steps)
        with torch.no_grad():
            expected = _flat(model(*new))
            actual = _flat(run(*new))
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert tuple(a.shape) == tuple(e.shape)
            assert max_error(a, e) <= TOL, (batch, steps)


def _lltm_ops(graph_module):
    """The targets of every call in the program (nested graphs, as scan's, included) that
    name lltm_cupy."""
    return sorted({str(n.target) for gm in graph_module.modules()
                   if isinstance(gm, torch.fx.GraphModule)
                   for n in gm.graph.nodes if n.op == "call_function" and "lltm" in str(n.target)})


# ------------------------------------------------------------------------- torch.jit.trace

@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_jit_trace_replays_at_other_sizes(name, grad, tmp_path):
    """jit.trace records torch operators (the sequence loop compiled by TorchScript): the
    trace, and the trace saved and loaded, equal the eager layer at other batch sizes and
    lengths, in grad mode and under no_grad (which used to record the backend's results as
    constants)."""
    model, args, _ = _model(name)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, args(3, 5))
        torch.jit.save(traced, tmp_path / "traced.pt")
        loaded = torch.jit.load(tmp_path / "traced.pt")
    _check_replays(traced, model, args)
    _check_replays(loaded, model, args)


def test_jit_trace_gradients_equal_eager():
    """The traced LLTM differentiates as the eager one does."""
    model, args, _ = _model("lltm-2-layers-bidirectional-batch-first-state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(model, args(3, 5))
    x, hx = args(2, 6)
    grads = []
    for run in (model, traced):
        out, (h, c) = run(x, hx)
        grads.append(torch.autograd.grad((out.square().sum() + h.sum() - c.sum()),
                                         list(model.parameters())))
    for g, e in zip(*grads):
        assert max_error(g, e) <= TOL


class _Wrapped(torch.nn.Module):
    """``fn(model, x)`` as a module (its parameters are the model's)."""

    def __init__(self, model, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, x):
        return self.fn(self.model, x)


def _packed(model, x):
    from torch.nn.utils.rnn import pack_padded_sequence

    return model(pack_padded_sequence(x, torch.tensor([5, 4, 2])))[1][0]


def _with_lengths(model, x):
    h = x.new_zeros(x.shape[1], S)
    return lt.lltm_sequence(x, model.weights_l0, model.bias_l0, h, h, lengths=[5, 4, 2])[0]


def _function(model, x):
    h = x.new_zeros(x.shape[1], S)
    return lt.LLTMFunction.apply(x[0], model.weights_l0, model.bias_l0, h, h)[0]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_jit_trace_refuses_what_it_cannot_record(grad):
    """Variable lengths and a direct call of the backends raise the library's error under
    jit.trace, in both grad modes (never a trace holding the results as constants)."""
    model, args, _ = _model("lltm")
    for fn, what in ((_packed, "PackedSequence"), (_with_lengths, "lengths="),
                     (_function, "NumPy/CuPy backends")):
        with torch.set_grad_enabled(grad), warnings.catch_warnings(), \
                pytest.raises(RuntimeError, match=rf"lltm_cupy.torch: .*{what}.* cannot be "
                                                  rf"recorded by torch.jit.trace"):
            warnings.simplefilter("ignore")
            torch.jit.trace(_Wrapped(model, fn), args(3, 5))


# ---------------------------------------------------------------------------- torch.compile

def test_compile_keeps_the_custom_operators_and_compiles_once_across_lengths():
    """torch.compile is not a recording: the compiled graph calls the library's operators (not
    the reference cell), and with dynamic=True one graph serves every length."""
    torch._dynamo.reset()
    model, args, _ = _model("lltm-2-layers-bidirectional-batch-first-state")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        # (the first call's sizes differ from each other, F, S and the 4 layers x directions:
        # Dynamo gives equal sizes one symbol and would then specialise them, a recompile)
        _check_replays(compiled, model, args, sizes=((2, 6), (7, 9), (4, 2)))
    assert len(graphs) == 1
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "lltm_cupy.sequence_inference.default" in ops, ops    # (_check_replays: no_grad)
    assert not any("addmm" in op for op in ops)
    torch._dynamo.reset()


@pytest.mark.parametrize("name, op", [("cell-state", "step_inference"),
                                      ("lltm-2-layers-bidirectional-batch-first-state",
                                       "sequence_inference")], ids=["cell", "lltm"])
def test_compile_is_not_taken_for_export_where_dynamo_folds_is_exporting(monkeypatch, name, op):
    """Dynamo before torch 2.13 folds ``torch.compiler.is_exporting()`` to True in every trace,
    torch.compile's included (torch 2.11 does): the layer must still tell torch.compile from
    torch.export there. Simulated here by the library's ``is_exporting`` always True (torch's
    own is left alone: Dynamo reads it to decide how to trace)."""
    from lltm_cupy.torch import _export

    monkeypatch.setattr(_export, "_is_exporting", lambda: True)
    torch._dynamo.reset()
    model, args, _ = _model(name)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        compiled(*args(3, 4))
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert f"lltm_cupy.{op}.default" in ops, ops
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- torch.export

@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.slow
def test_export_holds_torch_operators_only(strict):
    """torch.export (dynamic batch and steps, grad mode on) records torch operators only: no
    lltm_cupy operator before or after run_decompositions; the program equals the eager layer
    at other sizes, forward and gradients."""
    model, args, dims = _model("lltm-2-layers-bidirectional-batch-first-state")
    example = args(3, 5)
    if not _export._scan_gradients_ok():     # (torch 2.11's scan differentiates it wrongly)
        with pytest.raises(RuntimeError, match="scan returns wrong gradients"):
            torch.export.export(model, example, dynamic_shapes=_dynamic_shapes(example, dims),
                                strict=strict)
        return
    ep = torch.export.export(model, example, dynamic_shapes=_dynamic_shapes(example, dims),
                             strict=strict)
    assert _lltm_ops(ep.graph_module) == []
    decomposed = ep.run_decompositions()
    assert _lltm_ops(decomposed.graph_module) == []
    run = decomposed.module()
    _check_replays(run, model, args)
    x, hx = args(2, 6)
    grads = []
    for fn in (model, run):
        out, (h, c) = fn(x, hx)
        params = dict(fn.named_parameters())
        grads.append(torch.autograd.grad(out.square().sum() + h.sum() - c.sum(),
                                         [params[n] for n, _ in model.named_parameters()]))
    for g, e in zip(*grads):
        assert max_error(g, e) <= TOL


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.slow
def test_scan_gradients_refused_where_torch_gets_them_wrong(monkeypatch, tmp_path, strict):
    """On a torch whose scan differentiates the LLTM wrongly (2.11: 5.4 normalised, forward
    right), a differentiable export that records a scan is refused; under no_grad, a static
    number of steps (non-strict) and ONNX it still exports."""
    monkeypatch.setattr(_export, "_scan_gradients_ok", lambda: False)
    model, args, dims = _model("lltm")
    example = args(3, 5)
    shapes = _dynamic_shapes(example, dims)
    with pytest.raises(RuntimeError, match="scan returns wrong gradients"):
        torch.export.export(model, example, dynamic_shapes=shapes, strict=strict)
    with torch.no_grad():
        _check_replays(torch.export.export(model, example, dynamic_shapes=shapes,
                                           strict=strict).module(), model, args)
    if not strict:
        static = _dynamic_shapes(example, dims, steps=False)
        torch.export.export(model, example, dynamic_shapes=static, strict=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, example, str(tmp_path / "lltm.onnx"), dynamo=True,
                              dynamic_shapes=shapes, verbose=False)


def test_export_refuses_variable_lengths():
    model, args, _ = _model("lltm")
    for fn, what in ((_packed, "PackedSequence"), (_with_lengths, "lengths=")):
        with pytest.raises(RuntimeError, match=rf"lltm_cupy.torch: .*{what}.* cannot be "
                                               rf"recorded by torch.export"):
            torch.export.export(_Wrapped(model, fn), args(3, 5))


# ------------------------------------------------------------------------------------- ONNX

@pytest.fixture(scope="module")
def onnxruntime():
    pytest.importorskip("onnx", reason="onnx is not installed (pip install -e .[test])")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install -e .[test])")
    return pytest.importorskip("onnxruntime",
                               reason="onnxruntime is not installed (pip install -e .[test])")


def _onnx_replays(ort, path, model, args):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*inputs):
        flat = _flat(inputs)
        assert len(flat) == len(names)
        return [torch.from_numpy(a) for a in
                session.run(None, {n: t.numpy() for n, t in zip(names, flat)})]
    _check_replays(run, model, args)


# (exporter, configuration, grad mode): every configuration through TorchScript's exporter in
# both grad modes (under no_grad it wrote the export input's result as a constant), two through
# the dynamo exporter (slower: seconds each)
ONNX_CASES = ([(False, name, grad) for name in CONFIGS for grad in (True, False)]
              + [(True, "cell", True), (True, "lltm-2-layers-bidirectional-batch-first-state",
                                        False)])


@pytest.mark.parametrize("dynamo, name, grad", ONNX_CASES,
                         ids=[f"{'dynamo' if d else 'torchscript'}-{n}-{'grad' if g else 'no_grad'}"
                              for d, n, g in ONNX_CASES])
@pytest.mark.slow
def test_onnx_export_runs_in_onnxruntime(onnxruntime, tmp_path, dynamo, name, grad):
    """torch.onnx.export, no user code: onnxruntime's results equal the eager layer's at other
    batch sizes and lengths (both dynamic)."""
    model, args, dims = _model(name)
    example = args(3, 5)
    path = tmp_path / "model.onnx"
    if dynamo:
        kw = {"dynamic_shapes": _dynamic_shapes(example, dims)}
    else:
        names = [f"input_{i}" for i in range(len(_flat(example)))]
        axes = {names[0]: {dims["batch"][0]: "batch", **{d: "steps" for d in dims["steps"]}}}
        axes.update({n: {dims["batch"][-1]: "batch"} for n in names[1:]})
        kw = {"input_names": names, "dynamic_axes": axes}
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example, str(path), dynamo=dynamo, **kw)
    _onnx_replays(onnxruntime, path, model, args)


# ---------------------------------------------------------------------------- AOTInductor

_NO_LIBRARY = textwrap.dedent("""
    import sys

    class NoLLTM:       # importing lltm_cupy fails in this process
        def find_spec(self, name, path=None, target=None):
            if name == "lltm_cupy" or name.startswith("lltm_cupy."):
                raise ImportError("lltm_cupy must not be imported here")

    sys.meta_path.insert(0, NoLLTM())
    import torch

    data = torch.load(sys.argv[3])
    package = torch._inductor.aoti_load_package(sys.argv[1])
    program = torch.export.load(sys.argv[2]).module()
    for run, x, expected in ((package, data["x_package"], data["y_package"]),
                             (program, data["x_program"], data["y_program"])):
        out, (h, c) = run(x)
        for a, e in zip((out, h, c), expected):
            scale = max(1.0, e.abs().max().item())
            print(float((a - e).abs().max()) / scale)
    print("lltm_cupy imported:", sorted(m for m in sys.modules if m.split(".")[0] == "lltm_cupy"))
""")


@pytest.mark.slow
def test_aot_inductor_package_runs_without_the_library(tmp_path):
    """An inference model exported (no_grad), decomposed, compiled by AOTInductor into a package
    (static steps, dynamic batch) and saved by torch.export.save (dynamic steps and batch): both
    run in a fresh process where importing lltm_cupy fails, equal to the eager layer."""
    torch.manual_seed(0)
    model = lt.LLTM(F, S, num_layers=2, bidirectional=True).eval()      # state omitted
    example = (torch.randn(5, 3, F),)
    with torch.no_grad():
        static_steps = torch.export.export(model, example, dynamic_shapes=(
            {1: torch.export.Dim("batch")},)).run_decompositions()
        dynamic = torch.export.export(model, example, dynamic_shapes=(
            {0: torch.export.Dim("steps"), 1: torch.export.Dim("batch")},)).run_decompositions()
    assert _lltm_ops(static_steps.graph_module) == [] and _lltm_ops(dynamic.graph_module) == []
    package = torch._inductor.aoti_compile_and_package(
        static_steps, package_path=str(tmp_path / "lltm.pt2"))
    torch.export.save(dynamic, tmp_path / "program.pt2")
    x_package, x_program = torch.randn(5, 2, F), torch.randn(8, 4, F)
    with torch.no_grad():
        data = {"x_package": x_package, "y_package": _flat(model(x_package)),
                "x_program": x_program, "y_program": _flat(model(x_program))}
    torch.save(data, tmp_path / "data.pt")
    proc = subprocess.run([sys.executable, "-c", _NO_LIBRARY, package, str(tmp_path / "program.pt2"),
                           str(tmp_path / "data.pt")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "lltm_cupy imported: []"
    errors = [float(v) for v in lines[:-1]]
    assert len(errors) == 6 and max(errors) <= TOL, errors


# ----------------------------------------------------------------------------- quantization

def test_quantize_dynamic_leaves_the_lltm_in_float_onnxruntime_quantizes_it(onnxruntime,
                                                                            tmp_path):
    """docs/deploy.md: torch's quantize_dynamic quantizes a head nn.Linear and leaves the LLTM
    as it is; onnxruntime's quantize_dynamic with EnableSubgraph runs every layer's GEMM (inside
    the exported loop) with int8 weights, near the float model."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(0)
    model = torch.nn.Sequential(lt.LLTM(8, 32, num_layers=2), _Output(),
                                torch.nn.Linear(32, 4)).eval()
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.LSTM, torch.nn.Linear})
    assert type(quantized[0]) is lt.LLTM and quantized[0].weights_l0.dtype == torch.float32
    assert type(quantized[2]) is not torch.nn.Linear      # the head was quantized

    x = torch.randn(6, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(tmp_path / "float.onnx"), dynamo=False,
                          input_names=["input"], dynamic_axes={"input": {0: "steps", 1: "batch"}})
    quantize_dynamic(str(tmp_path / "float.onnx"), str(tmp_path / "int8.onnx"),
                     weight_type=QuantType.QInt8, extra_options={"EnableSubgraph": True})

    def op_types(graph, inside_loop=False):
        for node in graph.node:
            yield node.op_type, inside_loop
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    yield from op_types(attribute.g, True)
    ops = list(op_types(onnx.load(str(tmp_path / "int8.onnx")).graph))
    assert ops.count(("MatMulInteger", True)) == 2        # each layer's recurrent GEMM
    assert ("MatMulInteger", False) in ops                # the head
    session = onnxruntime.InferenceSession(str(tmp_path / "int8.onnx"),
                                           providers=["CPUExecutionProvider"])
    x = torch.randn(9, 2, 8)
    with torch.no_grad():
        expected = model(x)
    error = max_error(session.run(None, {"input": x.numpy()})[0], expected)
    assert 1e-5 < error < 5e-2      # int8 rounding: off by more than float32, by about 1%


class _Output(torch.nn.Module):
    """An LLTM's output without its states, for nn.Sequential."""

    def forward(self, out_and_state):
        return out_and_state[0]


# ------------------------------------------------------------ nn.LSTM beside it (docs/deploy.md)

@pytest.mark.slow
def test_nn_lstm_beside_it(onnxruntime, tmp_path):
    """What docs/deploy.md says nn.LSTM does, run beside the LLTM (torch 2.13, onnxruntime
    1.32): jit.trace replays it at other sizes and round-trips jit.save/load; the TorchScript
    ONNX exporter gives dynamic steps and batch; the dynamo exporter's file, given Dims for the
    steps and the batch, keeps the export's number of steps (5) in the Reshape that makes its
    output: at 9 steps (batch 3: 27 rows, not a multiple of 5) onnxruntime fails there, at 10
    steps (30 rows) it returns the output as (5, 6, 16) without an error, h_n and c_n right (the
    LLTM exported the same way is right at both); with the batch static that Reshape fails at
    every other number of steps; torch.export with a dynamic number of steps fails, with
    static steps it exports."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 16).eval()
    example = torch.randn(5, 3, 8)
    other = torch.randn(9, 2, 8)
    with torch.no_grad():
        want = lstm(other)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(lstm, (example,))
        torch.jit.save(traced, str(tmp_path / "lstm.pt"))
        loaded = torch.jit.load(str(tmp_path / "lstm.pt"))
        assert max_error(traced(other)[0], want) <= TOL
        assert max_error(loaded(other)[0], want) <= TOL

    def session(path, everything=False):
        s = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def run(x):
            out = [torch.from_numpy(a) for a in s.run(None, {s.get_inputs()[0].name: x.numpy()})]
            return out if everything else out[0]
        return run

    torch.manual_seed(1)
    ours = lt.LLTM(8, 16).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(lstm, (example,), str(tmp_path / "ts.onnx"), dynamo=False,
                          input_names=["input"], dynamic_axes={"input": {0: "steps", 1: "batch"}})
        for name, model, batch in (("dynamo", lstm, True), ("ours", ours, True),
                                   ("dynamo-static-batch", lstm, False)):
            dims = {0: torch.export.Dim("steps")}
            dims.update({1: torch.export.Dim("batch")} if batch else {})
            torch.onnx.export(model, (example,), str(tmp_path / f"{name}.onnx"), dynamo=True,
                              dynamic_shapes=(dims,), verbose=False)
    assert max_error(session(tmp_path / "ts.onnx")(other), want) <= TOL
    static_batch = session(tmp_path / "dynamo-static-batch.onnx")
    with torch.no_grad():
        assert max_error(static_batch(example), lstm(example)[0]) <= TOL
    for length in (9, 10):     # with the batch static, a Reshape to (5, 3, 16): fails
        with pytest.raises(Exception, match="Reshape"):
            static_batch(torch.randn(length, 3, 8))
    dynamo_run = session(tmp_path / "dynamo.onnx", everything=True)
    ours_run = session(tmp_path / "ours.onnx", everything=True)
    for length in (5, 9, 10):
        x = torch.randn(length, 3, 8)
        with torch.no_grad():
            expected, ours_expected = _flat(lstm(x)), _flat(ours(x))
        ours_got = ours_run(x)                     # the LLTM: right at every length
        assert [tuple(t.shape) for t in ours_got] == [tuple(t.shape) for t in ours_expected]
        assert all(max_error(g, e) <= TOL for g, e in zip(ours_got, ours_expected)), length
        if length == 9:        # 27 rows: onnxruntime fails in the Reshape to (5, -1, 16)
            with pytest.raises(Exception, match="Reshape"):
                dynamo_run(x)
            continue
        output, h_n, c_n = dynamo_run(x)
        assert tuple(output.shape) == (5, 3 * length // 5, 16)   # (5, 6, 16) at 10 steps: wrong
        assert max_error(output.reshape(length, 3, 16), expected[0]) <= TOL  # its elements in order
        assert max_error(h_n, expected[1]) <= TOL and max_error(c_n, expected[2]) <= TOL

    with pytest.raises(Exception, match="(?i)constraint"):
        torch.export.export(lstm, (example,), dynamic_shapes=({0: torch.export.Dim("steps")},))
    torch.export.export(lstm, (example,))


def test_variable_lengths_on_meta_tensors_are_refused_by_a_recording():
    """Meta example inputs run the shape stand-in (route 2): a recording of it would give a
    program that runs but computes other values, so variable lengths are refused first."""
    from lltm_cupy._packing import packed_plan
    from lltm_cupy.torch._ops import lltm_packed

    F, S = 4, 5

    def meta(*shape):
        return torch.empty(*shape, device="meta")

    plan = packed_plan(torch.tensor([3, 2, 2, 1]), False, "torch")

    class Packed(torch.nn.Module):
        def forward(self, d, w, b, h, c):
            return lltm_packed(d, w, b, h, c, plan)

    class Lengths(torch.nn.Module):
        def forward(self, x, w, b, h, c):
            return lt.lltm_sequence(x, w, b, h, c, lengths=[4, 2, 1])

    weights = (meta(3 * S, S + F), meta(3 * S), meta(3, S), meta(3, S))
    for module, x in ((Packed(), meta(8, F)), (Lengths(), meta(4, 3, F))):
        with pytest.raises(RuntimeError, match="cannot be recorded"):
            torch.export.export(module, (x, *weights))
        with pytest.raises(RuntimeError, match="cannot be recorded"):
            torch.jit.trace(module, (x, *weights))
