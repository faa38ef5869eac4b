"""DeepSpeed's own op builder files build through ``opbuilder.deepspeed`` with one import line changed.

The files come from the ``deepspeed`` sdist, fetched with pip at test time (once a run) into a temporary
folder and kept, checked by its sha256, in ``build/deepspeed-sdist/`` (ignored by git) for later runs and for a
machine that cannot reach the package index (copy the folder there); nothing of DeepSpeed is in this repository. Each test project holds DeepSpeed's ``op_builder/``
and ``csrc/`` as the sdist has them, with only the builder file's ``from .builder import ...`` line changed.

Two DeepSpeed versions, pinned so that a new release cannot change what is tested under the same name:
0.19.8 (``op_builder/cpu/*.py`` on ``CPUOpBuilder``, ``op_builder/fused_*.py`` on ``CUDAOpBuilder``) and
0.17.6 (``op_builder/cpu_*.py`` on ``TorchCPUOpBuilder``, the layout up to DeepSpeed 0.18).

The CPU builds (five ``torch/extension.h`` translation units, about 30 s of CPU each) happen once a run in
the shared test cache; the module runs on one pytest-xdist worker so that they are not repeated.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from helpers import ROOT, requires_cuda, run_python

from opbuilder import deepspeed as ds
from opbuilder.jit import toolchain
from opbuilder.errors import IncompatibleOpError

pytestmark = pytest.mark.xdist_group("test_deepspeed")

DS_VERSION = "0.19.8"
DS_OLD_VERSION = "0.17.6"

# pip's words for an index it cannot reach (no network, no DNS, a proxy refusing): only then is a test skipped.
_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|ConnectTimeout|ReadTimeout|ProxyError|"
    r"Could not fetch URL|connection broken|No route to host|timed out",
    re.IGNORECASE,
)

# What create_adam/create_lion print for each SIMD define (DeepSpeed's csrc/adam/cpu_adam_impl.cpp).
_SIMD_NAMES = {"-D__AVX512__": "AVX512", "-D__AVX256__": "AVX2", "-D__SVE__": "SVE", "-D__NEON__": "NEON",
               "-D__SCALAR__": "scalar"}


#: The sdists' sha256, as the package index publishes them: a download or a kept file that differs is refused.
SDIST_SHA256 = {
    "0.19.8": "9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af",
    "0.17.6": "b3318064ee5798e8a27d201ea8b888f0439973c4eac9af9ab381dd1862ebdf45",
}
#: Where a fetched sdist is kept for later runs (ignored by git); copy it to a machine without the index.
SDIST_DIR = ROOT / "build" / "deepspeed-sdist"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def ds_sdist(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(version)``: the deepspeed sdist of that version: kept in ``build/deepspeed-sdist/``, else fetched
    with pip (once a run) into a temporary folder and kept there."""
    found: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version in found:
            return found[version]
        kept = SDIST_DIR / f"deepspeed-{version}.tar.gz"
        if kept.is_file() and _sha256(kept) == SDIST_SHA256[version]:
            found[version] = kept
            return kept
        folder = tmp_path_factory.mktemp("deepspeed-sdist")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"deepspeed=={version}", "-d", str(folder), "--disable-pip-version-check"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        text = out.stdout + out.stderr
        if out.returncode != 0:
            if _UNREACHABLE.search(text):
                pytest.skip(f"the package index is unreachable, so the deepspeed {version} sdist cannot be fetched "
                            f"(or copy it to {kept}): {text.strip().splitlines()[-1]}")
            pytest.fail(f"`{' '.join(cmd)}` failed:\n{text[-3000:]}")
        fetched = folder / kept.name
        assert fetched.is_file(), text[-3000:]
        assert _sha256(fetched) == SDIST_SHA256[version], f"{fetched} is not the deepspeed {version} sdist"
        SDIST_DIR.mkdir(parents=True, exist_ok=True)
        partial = SDIST_DIR / f".{kept.name}.{os.getpid()}"
        shutil.copyfile(fetched, partial)
        os.replace(partial, kept)  # whole or not at all
        found[version] = kept
        return kept

    return get


def make_project(sdist: Path, dest: Path) -> Path:
    """DeepSpeed's ``op_builder/`` and ``csrc/`` from ``sdist``, unpacked into ``dest`` as the sdist has them."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        members = [m for m in tar.getmembers() if m.name.startswith((f"{top}/op_builder/", f"{top}/csrc/"))]
        for m in members:
            m.name = m.name[len(top) + 1:]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.11.4 on
        tar.extractall(dest, members=members, **safe)
    assert (dest / "csrc").is_dir() and (dest / "op_builder").is_dir()
    return dest


def import_builder(project: Path, relpath: str, old: str, new: str) -> ModuleType:
    """The builder file ``relpath`` with its import line ``old`` changed to ``new`` (the only change, checked),
    imported on its own (DeepSpeed's ``op_builder/__init__.py``, which imports deepspeed, is not run)."""
    path = project / relpath
    before = path.read_text().splitlines(keepends=True)
    after = [new + "\n" if line.rstrip("\n") == old else line for line in before]
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(changed) == 1, f"{relpath}: expected the line {old!r} exactly once, changed lines {changed}"
    path.write_text("".join(after))
    name = f"ds_{project.name}_{relpath.replace('/', '_').removesuffix('.py')}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def builder_classes(project: Path, files: dict[str, tuple[str, str]]) -> dict[str, type]:
    """{class name: class} of the builder files ``{relpath: (class name, base class)}`` in ``project``, each with
    ``from .builder import <base>`` changed to ``from opbuilder.deepspeed import <base>``."""
    return {cls: getattr(import_builder(project, relpath, f"from .builder import {base}",
                                        f"from opbuilder.deepspeed import {base}"), cls)
            for relpath, (cls, base) in files.items()}


@pytest.fixture(scope="session")
def new_builders(ds_sdist: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, type]:
    """DeepSpeed 0.19.8's builder classes by name, from a project with one line changed per builder file."""
    project = make_project(ds_sdist(DS_VERSION), tmp_path_factory.mktemp("ds-new"))
    return builder_classes(project, {
        "op_builder/cpu/cpu_adam.py": ("CPUAdamBuilder", "CPUOpBuilder"),
        "op_builder/cpu/cpu_adagrad.py": ("CPUAdagradBuilder", "CPUOpBuilder"),
        "op_builder/cpu/cpu_lion.py": ("CPULionBuilder", "CPUOpBuilder"),
        "op_builder/fused_adam.py": ("FusedAdamBuilder", "CUDAOpBuilder"),
        "op_builder/fused_lion.py": ("FusedLionBuilder", "CUDAOpBuilder"),
        "op_builder/fused_lamb.py": ("FusedLambBuilder", "CUDAOpBuilder"),
    })


@pytest.fixture(scope="session")
def old_builders(ds_sdist: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, type]:
    """DeepSpeed 0.17.6's TorchCPUOpBuilder builders by name."""
    project = make_project(ds_sdist(DS_OLD_VERSION), tmp_path_factory.mktemp("ds-old"))
    return builder_classes(project, {
        "op_builder/cpu_adagrad.py": ("CPUAdagradBuilder", "TorchCPUOpBuilder"),
        "op_builder/cpu_adam.py": ("CPUAdamBuilder", "TorchCPUOpBuilder"),
    })


#: DeepSpeed's CPU builders ask for ``-g``, a third of each of their translation units' compile time here (13 of
#: 36 s of CPU for cpu_lion_impl.cpp): the suite builds them with ``OPB_DEBUG=0``, DeepSpeed's flags less the
#: debug info. test_cpu_adam_compiles_the_simd_path checks that without it they reach the compiler as given.
NO_DEBUG_INFO = {"OPB_DEBUG": "0"}


@pytest.fixture(scope="session")
def cpu_adam(new_builders: dict[str, type]) -> ModuleType:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPB_DEBUG", NO_DEBUG_INFO["OPB_DEBUG"])
        builder = new_builders["CPUAdamBuilder"]()
        _asks_for_g_but_builds_without(builder)
        return builder.load()


@pytest.fixture
def no_debug_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OPB_DEBUG=0`` for the test (see NO_DEBUG_INFO)."""
    monkeypatch.setenv("OPB_DEBUG", NO_DEBUG_INFO["OPB_DEBUG"])


def _asks_for_g_but_builds_without(builder: Any) -> None:
    assert "-g" in builder.cxx_args(), "DeepSpeed's CPU builders pass -g"
    assert "-g" not in builder.final_cxx_args(), "OPB_DEBUG=0 drops it"


def _host_simd() -> str | None:
    """The best SIMD define the host's CPU supports, from /proc/cpuinfo (None when unknown)."""
    flags = set(toolchain.cpu_isa().split())
    if "avx512f" in flags:
        return "-D__AVX512__"
    if "avx2" in flags:
        return "-D__AVX256__"
    return None


# ---- DeepSpeed's CPU optimizers, built from its own builder files --------------------------------


def test_builder_files_resolve_sources_from_the_folder_holding_csrc(new_builders: dict[str, type]) -> None:
    builder = new_builders["CPUAdamBuilder"]()
    root = builder.source_root()
    assert (root / "csrc").is_dir() and (root / "op_builder" / "cpu" / "cpu_adam.py").is_file()
    assert builder.all_sources() == [root / "csrc/adam/cpu_adam.cpp", root / "csrc/adam/cpu_adam_impl.cpp"]
    assert builder.deepspeed_src_path("csrc/includes") == str(root / "csrc/includes")
    assert builder.BUILD_VAR == "DS_BUILD_CPU_ADAM" and builder.absolute_name() == "deepspeed.ops.adam.cpu_adam_op"
    assert builder.incompatibility_reasons() == [] and builder.is_compatible()


@pytest.mark.slow
def test_cpu_adam_matches_adamw(cpu_adam: ModuleType) -> None:
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.01
    gen = torch.Generator().manual_seed(0)
    n = 4099  # not a multiple of the SIMD width: the vector loop and the scalar tail both run
    param = torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    ref_param = param.double().clone()
    ref = torch.optim.AdamW([ref_param], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    cpu_adam.create_adam(7, lr, betas[0], betas[1], eps, wd, True, False)
    try:
        for step in range(1, 6):
            grad = torch.randn(n, generator=gen)
            ref_param.grad = grad.double()
            ref.step()
            cpu_adam.adam_update(7, step, lr, betas[0], betas[1], eps, wd, True, param, grad, exp_avg, exp_avg_sq)
    finally:
        cpu_adam.destroy_adam(7)
    state = ref.state[ref_param]
    torch.testing.assert_close(param.double(), ref_param, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exp_avg.double(), state["exp_avg"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(exp_avg_sq.double(), state["exp_avg_sq"], atol=1e-7, rtol=1e-5)


@pytest.mark.slow
def test_cpu_adam_compiles_the_simd_path(new_builders: dict[str, type], cpu_adam: ModuleType) -> None:
    builder = new_builders["CPUAdamBuilder"]()
    simd = builder.simd_width()
    host = _host_simd()
    if host is not None:  # an x86 CPU with AVX2 or AVX-512: -march=native enables it, so must the define
        assert simd == host
    args = builder.key_inputs()["cxx_args"]
    assert simd in args and builder.cpu_arch() in args and "" not in args
    # Without OPB_DEBUG, every flag DeepSpeed's builder gives reaches the compiler, in its order (-g too).
    given = builder.strip_empty_entries(builder.cxx_args())
    final = builder.final_cxx_args()
    assert "-g" in given and any(final[i:i + len(given)] == given for i in range(len(final))), (given, final)
    # A fresh process loads the cached build (no compile) and DeepSpeed's own log line names the path.
    code = textwrap.dedent(f"""\
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("ds_cpu_adam", {str(Path(sys.modules[new_builders['CPUAdamBuilder'].__module__].__file__))!r})
        module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
        op = module.CPUAdamBuilder().load()
        op.create_adam(3, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)
        op.destroy_adam(3)
        """)
    result = run_python(code, env=NO_DEBUG_INFO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "opbuilder: building" not in result.stderr, result.stderr[-3000:]
    assert f"Adam Optimizer #3 is created with {_SIMD_NAMES[simd]} arithmetic capability." in result.stdout
    if host is not None:
        assert "scalar" not in result.stdout


@pytest.mark.slow
def test_cpu_adagrad_matches_adagrad(new_builders: dict[str, type], no_debug_info: None) -> None:
    builder = new_builders["CPUAdagradBuilder"]()
    _asks_for_g_but_builds_without(builder)
    op = builder.load()
    _check_adagrad(op)


def _check_adagrad(op: ModuleType) -> None:
    lr, eps, wd = 0.1, 1e-8, 0.01
    gen = torch.Generator().manual_seed(1)
    n = 1031
    param, exp_avg_sq = torch.randn(n, generator=gen), torch.zeros(n)
    ref_param = param.double().clone()
    ref = torch.optim.Adagrad([ref_param], lr=lr, eps=eps, weight_decay=wd)
    op.create_adagrad(5, lr, eps, wd, False)
    try:
        for step in range(1, 6):
            grad = torch.randn(n, generator=gen)
            ref_param.grad = grad.double()  # before: DeepSpeed writes the update into grad's memory
            ref.step()
            op.adagrad_update(5, step, lr, eps, wd, param, grad, exp_avg_sq)
    finally:
        op.destroy_adagrad(5)
    torch.testing.assert_close(param.double(), ref_param, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exp_avg_sq.double(), ref.state[ref_param]["sum"], atol=1e-5, rtol=1e-5)


def _lion_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, lr: float, beta1: float,
                     beta2: float, wd: float) -> None:
    """One Lion step in place (Chen et al. 2023, decoupled weight decay), as DeepSpeed's kernels compute it."""
    update = torch.sign(beta1 * exp_avg + (1 - beta1) * grad)
    param.mul_(1 - lr * wd).add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


@pytest.mark.slow
def test_cpu_lion_matches_the_lion_update(new_builders: dict[str, type], no_debug_info: None) -> None:
    builder = new_builders["CPULionBuilder"]()
    _asks_for_g_but_builds_without(builder)
    op = builder.load()
    lr, beta1, beta2, wd = 1e-3, 0.9, 0.99, 0.1
    gen = torch.Generator().manual_seed(2)
    n = 2053
    param, exp_avg = torch.randn(n, generator=gen), torch.zeros(n)
    ref_param, ref_avg = param.double().clone(), exp_avg.double().clone()
    op.create_lion(4, lr, beta1, beta2, wd, False)
    try:
        for step in range(1, 6):
            grad = torch.randn(n, generator=gen)
            _lion_reference(ref_param, grad.double(), ref_avg, lr, beta1, beta2, wd)
            op.lion_update(4, step, lr, beta1, beta2, wd, param, grad, exp_avg)
    finally:
        op.destroy_lion(4)
    torch.testing.assert_close(param.double(), ref_param, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(exp_avg.double(), ref_avg, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_torch_cpu_op_builder_of_deepspeed_0_17(old_builders: dict[str, type]) -> None:
    """DeepSpeed up to 0.18 builds its CPU optimizers on TorchCPUOpBuilder (a CUDAOpBuilder)."""
    builder = old_builders["CPUAdagradBuilder"]()
    assert isinstance(builder, ds.TorchCPUOpBuilder) and builder.BUILD_VAR == "DS_BUILD_CPU_ADAGRAD"
    args = builder.key_inputs()["cxx_args"]
    assert builder.simd_width() in args and builder.cpu_arch() in args
    assert builder.get_cuda_compile_flag() in args
    assert ("-D__DISABLE_CUDA__" in args) == builder.build_for_cpu
    _check_adagrad(builder.load())


@pytest.mark.slow
def test_prebuild_reads_ds_build_and_opb_build(new_builders: dict[str, type], monkeypatch: pytest.MonkeyPatch,
                                               no_debug_info: None) -> None:
    builders = [new_builders["CPUAdagradBuilder"](), new_builders["FusedLambBuilder"]()]
    for var in ("DS_BUILD_OPS", "OPB_BUILD_OPS", "DS_BUILD_CPU_ADAGRAD", "OPB_BUILD_CPU_ADAGRAD", "DS_BUILD_FUSED_LAMB"):
        monkeypatch.delenv(var, raising=False)
    assert ds.prebuild(builders) == []
    monkeypatch.setenv("DS_BUILD_CPU_ADAGRAD", "1")
    assert ds.prebuild(builders) == ["cpu_adagrad"]
    monkeypatch.setenv("OPB_BUILD_CPU_ADAGRAD", "0")  # OPB_BUILD_<OP> wins over the builder's DS_BUILD_<OP>
    assert ds.prebuild(builders) == []
    monkeypatch.delenv("OPB_BUILD_CPU_ADAGRAD")
    if not builders[1].is_compatible():  # no GPU here: fused_lamb cannot be built
        monkeypatch.setenv("DS_BUILD_OPS", "1")
        assert ds.prebuild(builders) == ["cpu_adagrad"]  # skipped with its reason under DS_BUILD_OPS
        monkeypatch.setenv("DS_BUILD_FUSED_LAMB", "1")  # asked for by name: an error that says why
        with pytest.raises(IncompatibleOpError, match="fused_lamb"):
            ds.prebuild(builders)


# ---- DeepSpeed's CUDA optimizers (the GPU machine) -------------------------------------------------


def test_cuda_builder_without_cuda_says_why(new_builders: dict[str, type], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    builder = new_builders["FusedAdamBuilder"]()
    if builder.with_cuda():
        pytest.skip("CUDA can be compiled here: the GPU tests below build fused_adam")
    reasons = builder.incompatibility_reasons()
    assert reasons and ".cu sources cannot be compiled here" in reasons[0]
    assert not builder.is_compatible()
    with pytest.raises(IncompatibleOpError, match=r"fused_adam.*\.cu sources cannot be compiled here"):
        builder.load()


@requires_cuda
def test_fused_adam_matches_adamw_on_cuda(new_builders: dict[str, type]) -> None:
    op = new_builders["FusedAdamBuilder"]().load()
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.01
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4099,), (33, 65)]  # several tensors in one multi-tensor launch
    params = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    ref_params = [p.double().clone() for p in params]
    ref = torch.optim.AdamW(ref_params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    for step in range(1, 6):
        grads = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        for rp, g in zip(ref_params, grads):
            rp.grad = g.double()
        ref.step()
        op.multi_tensor_adam(2048 * 32, noop, [grads, params, ms, vs], lr, beta1, beta2, eps, step, 1, 1, wd)
    for p, rp in zip(params, ref_params):
        torch.testing.assert_close(p.double(), rp, atol=1e-5, rtol=1e-5)


@requires_cuda
def test_fused_lion_matches_the_lion_update_on_cuda(new_builders: dict[str, type]) -> None:
    op = new_builders["FusedLionBuilder"]().load()
    lr, beta1, beta2, wd = 1e-3, 0.9, 0.99, 0.1
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(2053,), (17, 129)]
    params = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    ms = [torch.zeros_like(p) for p in params]
    ref_params, ref_ms = [p.double().clone() for p in params], [m.double().clone() for m in ms]
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    for step in range(1, 6):
        grads = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        for rp, rm, g in zip(ref_params, ref_ms, grads):
            _lion_reference(rp, g.double(), rm, lr, beta1, beta2, wd)
        op.multi_tensor_lion(2048 * 32, noop, [grads, params, ms], lr, beta1, beta2, step, wd)
    for p, rp in zip(params, ref_params):
        torch.testing.assert_close(p.double(), rp, atol=1e-6, rtol=1e-6)


@requires_cuda
def test_cuda_flags_follow_deepspeed_jit(new_builders: dict[str, type]) -> None:
    builder = new_builders["FusedAdamBuilder"]()
    nvcc = builder.key_inputs()["nvcc_args"]
    gencodes = [a for a in nvcc if a.startswith("-gencode")]
    assert gencodes and len(gencodes) == len(set(gencodes))  # the base's and compute_capability_args()'s, once
    assert "" not in nvcc and "-lineinfo" in nvcc and "-UC10_USE_GLOG" in nvcc
    bf16 = all(int(a.split(".")[0]) >= 8 for a in builder.cuda_archs())
    assert ("-DBF16_AVAILABLE" in nvcc) == bf16 == ("-DBF16_AVAILABLE" in builder.key_inputs()["cxx_args"])


# ---- DeepSpeed's API, on small builders of our own (no sdist, no compile) --------------------------


def _write_builder(root: Path, body: str, base: str = "CPUOpBuilder") -> ModuleType:
    (root / "csrc").mkdir(parents=True, exist_ok=True)
    (root / "csrc" / "op.cpp").write_text("#include <torch/extension.h>\n")
    folder = root / "op_builder"
    folder.mkdir(exist_ok=True)
    path = folder / "my_op.py"
    path.write_text(f"from opbuilder.deepspeed import {base}\n\n" + body)
    spec = importlib.util.spec_from_file_location(f"ds_mine_{root.name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_PLAIN = textwrap.dedent("""\
    class MyBuilder({base}):
        BUILD_VAR = "DS_BUILD_MY_OP"
        NAME = "my_op"

        def __init__(self):
            super().__init__(name=self.NAME)

        def absolute_name(self):
            return "mine.my_op"

        def sources(self):
            return ["csrc/op.cpp"]
    """)


def test_an_incompatible_builder_says_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    module = _write_builder(tmp_path, _PLAIN.format(base="CPUOpBuilder") + textwrap.indent(textwrap.dedent("""\
        def is_compatible(self, verbose=False):
            if not self.has_function("opb_no_such_function_anywhere", ["c"]):
                self.warning(f"{self.NAME} needs libfoo (install libfoo-dev)")
                return False
            return super().is_compatible(verbose)
        """), "    "))
    builder = module.MyBuilder()
    with caplog.at_level(logging.WARNING, logger="opbuilder"):
        assert not builder.is_compatible(verbose=True)
    assert "needs libfoo" in caplog.text
    with pytest.raises(IncompatibleOpError, match=r"'my_op' cannot be built here: my_op needs libfoo"):
        builder.load()


def test_missing_sources_name_the_folder_they_were_looked_for_in(tmp_path: Path) -> None:
    module = _write_builder(tmp_path, _PLAIN.format(base="CPUOpBuilder").replace('"csrc/op.cpp"', '"csrc/gone.cpp"'))
    builder = module.MyBuilder()
    assert builder.source_root() == tmp_path
    with pytest.raises(IncompatibleOpError, match=re.escape(str(tmp_path / "csrc" / "gone.cpp"))):
        builder.load()


def test_has_function_finds_a_real_libc_function(tmp_path: Path) -> None:
    builder = _write_builder(tmp_path, _PLAIN.format(base="CPUOpBuilder")).MyBuilder()
    assert builder.has_function("puts", ["c"])
    assert not builder.has_function("opb_no_such_function_anywhere", ["c"])
    assert builder.command_exists("sh") and not builder.command_exists("opb-no-such-command|opb-nor-this")


def test_builder_for_setup_py_says_what_to_use_instead(tmp_path: Path) -> None:
    builder = _write_builder(tmp_path, _PLAIN.format(base="CPUOpBuilder")).MyBuilder()
    with pytest.raises(NotImplementedError, match=r"prebuild.*DS_BUILD_<OP>=1"):
        builder.builder()


def test_flags_are_stripped_and_extend_the_base(tmp_path: Path) -> None:
    body = _PLAIN.format(base="CPUOpBuilder") + textwrap.indent(textwrap.dedent("""\
        def cxx_args(self):
            return super().cxx_args() + ["", "-DMY_FLAG"]

        def libraries_args(self):
            return ["", "m"]
        """), "    ")
    builder = _write_builder(tmp_path, body).MyBuilder()
    args = builder.final_cxx_args()
    assert "" not in args and "-DMY_FLAG" in args and "-UC10_USE_GLOG" in args
    assert builder.simd_width() in args and "-Wno-reorder" in args
    assert builder.final_ldflags()[-1] == "-lm" and "" not in builder.final_ldflags()
    assert builder.strip_empty_entries(["", "-a", "", "-b"]) == ["-a", "-b"]


@pytest.mark.skipif(not re.search(r"x86_64|amd64", toolchain.cpu_isa() + " " + __import__("platform").machine(), re.I),
                    reason="x86 -march names")
@pytest.mark.parametrize(("arch", "expected"), [("x86-64", "-D__SCALAR__"), ("x86-64-v3", "-D__AVX256__"),
                                                ("x86-64-v4", "-D__AVX512__"), ("none", "-D__SCALAR__")])
def test_simd_width_follows_the_march_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                              expected: str) -> None:
    """The SIMD define asks only for what -march enables: a portable build must not get -D__AVX512__."""
    monkeypatch.setenv("OPB_CPU_ARCH", arch)
    builder = _write_builder(tmp_path, _PLAIN.format(base="CPUOpBuilder")).MyBuilder()
    assert builder.cpu_arch() == ("" if arch == "none" else f"-march={arch}")
    assert builder.simd_width() == expected


@pytest.mark.skipif(toolchain.nvcc_path() is None or toolchain.torch_cuda_version() is None,
                    reason="needs nvcc and a CUDA build of torch (nothing runs on a GPU)")
def test_filter_ccs_prunes_the_archs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = _PLAIN.format(base="CUDAOpBuilder").replace('["csrc/op.cpp"]', '["csrc/op.cpp", "csrc/k.cu"]') + \
        textwrap.indent(textwrap.dedent("""\
        def filter_ccs(self, ccs):
            return [cc.split(".") for cc in ccs if int(cc.split(".")[0]) >= 8]

        def nvcc_args(self):
            return super().nvcc_args() + ["", "-lineinfo"]
        """), "    ")
    module = _write_builder(tmp_path, body, base="CUDAOpBuilder")
    (tmp_path / "csrc" / "k.cu").write_text("__global__ void k() {}\n")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0;8.0;9.0")
    builder = module.MyBuilder()
    assert builder.cuda_archs() == ["8.0", "9.0"] and not builder.build_for_cpu
    nvcc = builder.final_nvcc_args()
    assert [a for a in nvcc if a.startswith("-gencode")] == ["-gencode=arch=compute_80,code=sm_80",
                                                           "-gencode=arch=compute_90,code=sm_90"]
    assert "" not in nvcc and "-lineinfo" in nvcc and "-DBF16_AVAILABLE" in nvcc
    # ATen's CUDA headers include cusparse.h: its folder is searched, after the toolkit's, when not the toolkit's.
    headers = toolchain.cuda_header_dir("cusparse.h")
    if headers is not None and headers.resolve() != (Path(toolchain.cuda_home()) / "include").resolve():
        assert nvcc[nvcc.index(str(headers)) - 1] == "-isystem"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0")
    builder = module.MyBuilder()
    assert builder.build_for_cpu
    with pytest.raises(IncompatibleOpError, match=r"filter_ccs\(\) keeps none of the CUDA archs 7.0"):
        builder.load()


@pytest.mark.skipif(toolchain.nvcc_path() is None or toolchain.torch_cuda_version() is None,
                    reason="needs nvcc and a CUDA build of torch (nothing runs on a GPU)")
def test_torch_cpu_op_builder_links_curand_where_cuda_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's TorchCPUOpBuilder links cuRAND and passes -D__ENABLE_CUDA__ when CUDA can be built;
    cuRAND is found in the toolkit or in torch's nvidia wheel (an nvcc-only toolkit has none)."""
    builder_class = _write_builder(tmp_path, _PLAIN.format(base="TorchCPUOpBuilder"), base="TorchCPUOpBuilder").MyBuilder
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    builder = builder_class()
    assert not builder.build_for_cpu and "-D__ENABLE_CUDA__" in builder.final_cxx_args()
    curand = toolchain.find_cuda_library("curand")
    if curand is not None:
        assert builder.final_ldflags()[-len(curand.ldflags()):] == curand.ldflags()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")  # no arch, no GPU here: CPU only, as DeepSpeed without a GPU
    if not torch.cuda.is_available():
        builder = builder_class()
        assert builder.build_for_cpu and "-D__DISABLE_CUDA__" in builder.final_cxx_args()
        assert builder.final_ldflags()[-1] == "-fopenmp"
