import functools
import os

import pytest
import torch
import transformers

# Without a GPU the Triton kernels run in Triton's interpreter; @triton.jit reads this when a kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # it imports Triton: after the line above

from dflash_compile.testing import (TINY_CONFIGS, in_installed_transformers, load_tiny_model, random_drafter_weights,
                                    save_drafter, save_tiny_model, tiny_drafter_config)

# Under pytest-xdist (the README's `-n 2`: one worker per core of the CI machine) each worker computes on one thread
# and compiles in its own process: two workers' intra-op threads and Inductor's compile pools on two cores slowed the
# longest tests 2-3x.
# On a GPU each worker also keeps its own Inductor cache: two workers compiling the same graph at once wrote one
# shared .so and one loaded it half-written ("main.so: file too short", torch 2.11 with -n 4). Not on the CPU, where
# it never happened in CI and the shared cache keeps CI's runs warm (per-worker caches, cold: 1324 s against 687).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    if torch.cuda.is_available():
        shared = os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # the controller may have set it
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{shared}_{os.environ['PYTEST_XDIST_WORKER']}"

# Inductor's CPU kernels compile without SIMD in the tests: a compile's time is mostly the C++ compiler's, and scalar
# kernels compile in two thirds of the vectorized ones' time (five families' compiled logits with an empty Inductor
# cache: 44-47 s against 64 s on the 2-core CI machine); the models are tiny, so their run time does not show, and the
# library's own kernels on the CPU are csrc's and Triton's, untouched by this.
if not torch.cuda.is_available():
    torch._inductor.config.cpp.vec_isa_ok = False

# the families the installed transformers has (MiniCPM5-MoE came in 5.25)
FAMILIES = sorted(family for family in TINY_CONFIGS if in_installed_transformers(family))
# the families whose attention projections on one input are one linear already: DBRX's q/k/v (`Wqkv`), JetMoE's
# k/v (`kv_proj`; its queries come from its attention experts), Ergo's q/k/v (`qkv_proj`), and whose MLPs have no
# gate: nothing for `share_storage` to group; Inkling 2's projections are modules of their own (norms, clips and
# convolutions around each linear), its MLPs all routed
ONE_LINEAR_PROJECTIONS = ("dbrx", "jetmoe", "ergo", "inkling2", "inkling2_loop")


def traceable_forward(family: str) -> dict:
    """Keyword arguments of a plain forward that Dynamo traces whole: looped Inkling 2's forward copies transformers'
    cache layers for its later passes (copy.deepcopy, a graph break) unless it gets no cache; the decoder's cache is
    never copied."""
    return {"use_cache": False} if family == "inkling2_loop" else {}


def pytest_collection_modifyitems(items):
    """A test naming a family the installed transformers lacks in its parameters is skipped, saying why."""
    missing = set(TINY_CONFIGS) - set(FAMILIES)
    skip = pytest.mark.skip(reason=f"transformers {transformers.__version__} lacks {sorted(missing)}")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec and missing.intersection(callspec.id.split("-")):
            item.add_marker(skip)

# Triton kernels run on CPU tensors only in the interpreter, which stays off where CUDA is (the GPU tests need it off).
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(),
                                       reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1, off with CUDA")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch, so compile counts and explain output do not depend on test order."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def compiled_steps(request, monkeypatch):
    """On a CPU `optimize`'s compiled steps and drafter calls are lowered by AOT eager, not Inductor, unless the test
    is marked `inductor`: Dynamo still captures each whole and the dflash passes rewrite the steps, and Inductor's C++
    compile, most of a compiled test's time with an empty compile cache, is left to the marked tests, which lower
    each family's kind of attention and router (test_speculative.py's identity test) and the drafter (test_pair.py),
    and to the forwards test_backend.py compiles. On a GPU every test lowers by Inductor (its Triton code is the
    product). Returns the list each compiled step's graph report goes to (`explain`'s kind: matches, the graph
    before and after the passes)."""
    from dflash_compile import speculative
    from dflash_compile.backend import compile_graph

    reports = []
    inductor = torch.cuda.is_available() or request.node.get_closest_marker("inductor")
    lowering = {} if inductor else {"lowering": "aot_eager"}

    @functools.cache  # one backend per set of options, as `dflash_backend_with`: Dynamo shares graphs between them
    def backend_with(**options):
        return functools.partial(compile_graph, options=options | lowering, on_graph=reports.append)

    monkeypatch.setattr(speculative, "dflash_backend_with", backend_with)
    if not inductor:
        monkeypatch.setattr(speculative, "DRAFTER_BACKEND", "aot_eager")
    return reports


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One saved checkpoint per family, written once per session and loaded with from_pretrained by the tests."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = save_tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return get


@pytest.fixture
def tiny(tiny_dirs):
    def load(family, dtype=torch.float32, **kwargs):
        return load_tiny_model(family, dtype, tiny_dirs(family), **kwargs)

    return load


def token_ids(batch=2, length=9, vocab=128, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def random_drafter(tmp_path):
    """A random DFlash drafter for `model` saved in a temp dir: make(model, block_size=4, **config overrides)."""
    def make(model, block_size=4, **kwargs):
        config = tiny_drafter_config(model.config, block_size=block_size, **kwargs)
        return save_drafter(tmp_path / "drafter", config, random_drafter_weights(config))

    return make
