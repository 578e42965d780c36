"""The op registry (codegen/ops.toml) and its generator (scripts/gen_ops.py): a row reaches
every layer, a bad row is refused naming it, and the installed package has every op."""
import importlib.util
import os

import pytest

import treetensor.torch as ttorch
from treetensor import _C
from conftest import ROOT


def generator():
    spec = importlib.util.spec_from_file_location("gen_ops", os.path.join(ROOT, "scripts", "gen_ops.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = generator()
REGISTRY = open(os.path.join(ROOT, "codegen", "ops.toml")).read()
NEW = len(GEN.load(REGISTRY)) + 1  # the row number of a row with_row() adds


def with_row(row):
    """The registry's text with one more row at the end of `ops`."""
    head, tail = REGISTRY.rsplit("]", 1)
    return head + "  " + row + ",\n]" + tail


def test_a_new_row_reaches_every_generated_file():
    rows = GEN.load(with_row('{ name = "sinc", shape = "unary_inplace", foreach = false, libm = false, integer = false, doc = "sin(pi x) / (pi x)" }'))
    texts = {rel: render(rows) for rel, render in GEN.OUTPUTS.items()}
    for rel, text in texts.items():
        assert "sinc" in text, rel
    assert "TreeTensor sinc(const TensorTree& t);" in texts["include/treetensor/tensor/ops_generated.hpp"]
    assert "TreeTensor& sinc_();" in texts["include/treetensor/tensor/tree_tensor_ops.inc"]
    assert 'unary_update("sinc_", t, [](const at::Tensor& x) { x.sinc_(); },' in texts["src/tensor/ops_generated.inc"]
    assert "(void)outs::sinc_out(r, x);" in texts["src/tensor/fuse_ops.inc"]
    assert '"sinc(t): sin(pi x) / (pi x), on every leaf (torch.sinc without a tree).");' in \
        texts["python/src/ops_generated.inc"]
    assert '"sinc",' in texts["python/treetensor/_ops.py"]
    assert "{ x.sinc_(); }}," in texts["tests/op_cases.hpp"]
    assert '"sinc",' not in texts["tests/op_cases.hpp"].split("libm_function")[1]  # libm = false
    libm = GEN.load(with_row('{ name = "sinc", shape = "unary", foreach = false, libm = true, integer = false, doc = "x" }'))
    assert '"sinc",' in GEN.OUTPUTS["tests/op_cases.hpp"](libm).split("libm_function")[1]
    body = texts["src/tensor/ops_generated.inc"]
    assert '"sinc",' not in body.split("registry_integer")[1].split("};")[0]  # integer = false
    integer = GEN.load(with_row('{ name = "sinc", shape = "unary", foreach = false, libm = false, integer = true, doc = "x" }'))
    assert '"sinc",' in GEN.OUTPUTS["src/tensor/ops_generated.inc"](integer).split("registry_integer")[1].split("};")[0]


def test_rows_with_a_scalar_argument_reach_every_layer_but_fuse():
    """ternary_value (at::addcmul's signature) and binary_weight (at::lerp's): the free
    functions, methods, bodies, bindings with torch's argument names and test cases; no fuse()
    form (Expr records ops of one or two operands)."""
    rows = GEN.load(with_row('{ name = "addcmul2", shape = "ternary_value", foreach = true, libm = false, integer = false, doc = "x" }'))
    rows += GEN.load(with_row('{ name = "lerp2", shape = "binary_weight", foreach = false, libm = false, integer = false, doc = "y" }'))[-1:]
    texts = {rel: render(rows) for rel, render in GEN.OUTPUTS.items()}
    for rel, text in texts.items():
        fused = rel.startswith(("include/treetensor/tensor/fuse", "src/tensor/fuse"))
        assert ("addcmul2" in text) != fused and ("lerp2" in text) != fused, rel
    header = texts["include/treetensor/tensor/ops_generated.hpp"]
    assert ("TreeTensor addcmul2(const Operand& self, const Operand& tensor1, const Operand& tensor2,\n"
            "                    const at::Scalar& value = 1);") in header  # as clang-format wraps it
    assert "TreeTensor& lerp2_(TreeTensor& self, const Operand& end, const at::Scalar& weight);" in header
    body = texts["src/tensor/ops_generated.inc"]
    assert "at::_foreach_addcmul2_(s, a, b, v);" in body and "x.lerp2_(y, v); },\n      nullptr);" in body
    python = texts["python/src/ops_generated.inc"]
    assert 'py::arg("tensor1"), py::arg("tensor2"), py::kw_only(), py::arg("value") = 1,' in python
    assert 'return torch_attr("lerp2")(input, end, weight);' in python
    assert "tt::addcmul2_(a, b, c, v)" in texts["tests/op_cases.hpp"]


@pytest.mark.parametrize("row, message", [
    ('{ name = "sinc", shape = "ternary", foreach = false, libm = false, integer = false, doc = "x" }',
     f"row {NEW} (sinc): shape must be one of unary_inplace, unary, binary_scalar, binary_tensor, "
     "ternary_value, binary_weight, blas"),
    ('{ name = "abs", shape = "unary", foreach = false, libm = false, integer = false, doc = "x" }', "(abs): name must be a new C++ identifier"),
    ('{ name = "a-b", shape = "unary", foreach = false, libm = false, integer = false, doc = "x" }', "(a-b): name must be a new C++ identifier"),
    ('{ name = "sinc", shape = "unary", libm = true, integer = false, doc = "x" }',
     "columns are name, shape, foreach, libm, integer, doc; got ['doc', 'integer', 'libm', 'name', 'shape']"),
    ('{ name = "sinc", shape = "unary", foreach = "no", libm = false, integer = false, doc = "x" }', "(sinc): foreach must be true or false"),
    ('{ name = "sinc", shape = "unary", foreach = false, libm = false, integer = false, doc = "a \\"quoted\\" doc" }', "(sinc): doc must be one line"),
    ('{ name = "hypot", shape = "binary_tensor", foreach = true, libm = false, integer = false, doc = "x" }',
     "(hypot): only unary_inplace, binary_scalar, ternary_value, binary_weight ops have a foreach form"),
    ('"sinc"', f"row {NEW} (?): columns are name, shape, foreach, libm, integer, doc; got a str"),
    ('{ name = "sinc", shape = "unary", foreach = false, libm = 1, integer = false, doc = "x" }', "(sinc): libm must be true or false"),
    ('{ name = "sinc", shape = "unary", foreach = false, libm = false, integer = "yes", doc = "x" }', "(sinc): integer must be true or false"),
])
def test_a_bad_row_is_refused_naming_it(row, message):
    with pytest.raises(SystemExit) as e:
        GEN.load(with_row(row))
    assert message in str(e.value)
    assert str(e.value).startswith("ops.toml: row ")


def test_a_file_that_is_no_registry_is_refused():
    for text, message in [("ops = [", "not a registry"), ("rows = []", "not a registry"),
                          ("ops = 3", "`ops` must be an array of rows")]:
        with pytest.raises(SystemExit) as e:
            GEN.load(text)
        assert message in str(e.value)


def test_the_package_has_every_op_of_the_registry():
    for op in GEN.load(REGISTRY):
        n = op["name"]
        # ttorch's function may wrap _C's (DI-treetensor's calling convention, torch.py)
        assert callable(getattr(ttorch, n)) and op["doc"] in getattr(_C, n).__doc__, n
        assert op["doc"] in getattr(_C.Tensor, n).__doc__, n
        if op["shape"] in ("unary_inplace", "binary_scalar"):
            assert callable(getattr(ttorch.Tensor, n + "_")), n
