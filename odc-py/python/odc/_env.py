"""Every environment variable ODC reads: one table, the source of the docs' configuration page.

A name read anywhere in the repository's Rust or Python code (``std::env::var``,
``os.environ``, or a constant holding the name) is a row here, and every row is
read somewhere: ``scripts/env-check.py`` (in ``make lint``) compares the two.
The docs build renders :data:`ENVIRONMENT` as the configuration page.

This module imports nothing, so that the check and the docs build load it
without torch or the native core.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ENVIRONMENT", "SECTIONS", "EnvVar"]


class EnvVar(NamedTuple):
    """One environment variable ODC reads.

    Attributes:
        name: the variable, ``ODC_...``.
        default: what applies when it is unset, in words.
        reader: who reads it: the Rust crate and module, or the Python module.
        meaning: what it sets, and the values it takes.
        section: one of :data:`SECTIONS`' keys.
    """

    name: str
    default: str
    reader: str
    meaning: str
    section: str


SECTIONS: dict[str, str] = {
    "engine": "The engine (every transport)",
    "fabric": "libfabric, between hosts",
    "gpu": "GPUs and the device data path",
    "python": "The Python package: process group, FSDP, trainers, tools",
    "tests": "Tests and harnesses (not settings: the test suites and their helper processes read these)",
}
"""Section key → heading, in the order the configuration page shows them."""

ENVIRONMENT: tuple[EnvVar, ...] = (
    # -- the engine ----------------------------------------------------------------------------------------------
    EnvVar("ODC_TIMEOUT_S", "300 (under a process group: the group's timeout)",
           "odc-core `engine::config` (`EngineConfig::default`); `odc.deadline`",
           "Deadline in seconds of every wait on a peer. A `timeout=` argument wins over it; it wins over a "
           "process group's timeout. A `PeerTimeout` carries a note naming the deadline and where it came from. "
           "A value that is not positive seconds is a `ConfigError`.",
           "engine"),
    EnvVar("ODC_TRANSPORT", "`auto`",
           "`odc.engine`, `odc.fsdp`, `odc.backend`, `odc.bench`; the test worker `odc-rank-worker`",
           "The transport of every engine the process creates: `auto` (`shm` on one node, else `mixed`), `shm`, "
           "`fabric`, `mixed` (shared memory within a node, libfabric between nodes), `cuda-ipc` (CUDA tensors, one "
           "node), `nvshmem` (CUDA tensors, any number of nodes), `emu-ipc` / `emu-shmem` (the device paths on CPU "
           "tensors, for tests). `odc.fsdp` picks `cuda-ipc` / `nvshmem` for CUDA parameters by itself; in the `odc` "
           "backend a CUDA transport sets its CUDA engines and any other name its CPU engines.",
           "engine"),
    EnvVar("ODC_LANDING_MB", "256", "odc-core `engine::config`",
           "Per-rank budget of landing slots in MiB. The landing chunk (2 MiB) shrinks as the shard group grows, "
           "down to 64 KiB; a group that does not fit even then fails at registration naming the budget it needs. "
           "A value that is not a positive whole number is a `ConfigError` when the engine starts.",
           "engine"),
    EnvVar("ODC_NODE_CACHE_MB", "1024 where nodes are joined by a network (`mixed`), off on `shm`",
           "odc-core `engine::config`",
           "Per-node bound in MiB of the node cache of remote shards (full sharding across nodes): a version of a "
           "shard owned on another node crosses once per node and serves every node-mate's gathers of it; beyond "
           "the bound the least recently used pieces are evicted, those every node-mate has read first; `0` "
           "turns it off; fractions such as `0.5` are allowed; anything else (negative, `1GiB`) is a `ConfigError` "
           "when the engine starts. On `nvshmem` the cache is device memory and evicts nothing: it holds every "
           "remote shard, none beyond the default bound, and an explicit bound below that is a `ConfigError` "
           "naming the MiB needed. Equal on every rank.",
           "engine"),
    EnvVar("ODC_CROSS_NODE", "`auto`", "odc-core `engine::config`",
           "How gradients for owners on other nodes cross under full sharding: `direct` (every rank pushes its own), "
           "`node` (summed on the node, pushed once per node when its last rank finished the minibatch), `auto` "
           "(`node` where nodes are joined by a network, `direct` on one host, on `nvshmem` or with deterministic "
           "sums); another "
           "name is a `ConfigError` when the engine starts. Equal on every rank.", "engine"),
    EnvVar("ODC_JOB_KEY", "`default` (the `odc` backend: torchelastic's run id, else a random token)",
           "odc-core `engine::config`; `odc.backend`",
           "Names this job's shared-memory segments, so that two jobs on one host do not meet. A crashed run's "
           "leftovers, of any key, are removed at the next start of an engine on the host.",
           "engine"),
    EnvVar("ODC_KERNELS_ISA", "the best the CPU has (AVX2 + F16C, else scalar)", "odc-kernels `cpu`",
           "`scalar` forces the portable CPU kernels (for comparisons and debugging); it can only lower the level.",
           "engine"),
    # -- libfabric -----------------------------------------------------------------------------------------------
    EnvVar("ODC_FABRIC_ADDR", "`127.0.0.1`; across nodes `odc.Engine` binds the address on the route to "
           "`MASTER_ADDR`", "odc-core `transport::fabric`; `odc.engine`",
           "The address libfabric binds (any port): this host's address on the fabric network.", "fabric"),
    EnvVar("ODC_FABRIC_INCLUDE_DIR", "libfabric's pkg-config `includedir`, else `/usr/include`",
           "odc-core `build.rs` (at build time)",
           "Where the build finds `rdma/fabric.h` for the libfabric transport's C shim: a folder of its own for a "
           "libfabric installed outside the compiler's search (a cluster's module, a conda environment); the "
           "built library opens libfabric at run time either way.",
           "fabric"),
    EnvVar("ODC_FABRIC_PROVIDER", "`tcp`", "odc-core `transport::fabric`",
           "The libfabric provider: `tcp` (through `ofi_rxm`), `verbs`, `efa`.", "fabric"),
    EnvVar("ODC_FABRIC_READS", "8", "odc-core `transport::fabric`",
           "Single reads in flight per rank (a gather's batch keeps up to 128).", "fabric"),
    EnvVar("ODC_FABRIC_REORDER", "off", "odc-core `transport::fabric`",
           "A seed: every progress thread holds each completion back up to 3 ms and hands them on in a seeded "
           "random order, so that nothing may rely on two operations completing in the order they were posted. "
           "For tests; slower.", "fabric"),
    # -- GPUs ----------------------------------------------------------------------------------------------------
    EnvVar("ODC_NVRTC_LIB", "the interpreter's `nvidia-cuda-nvrtc` wheel, then a system CUDA",
           "odc-kernels `cuda::nvrtc`",
           "Path of the NVRTC library (`libnvrtc.so.13` or `.so.12`), or a folder holding it.", "gpu"),
    EnvVar("ODC_NVSHMEM_LIB", "the interpreter's `nvidia-nvshmem` wheel, then a system install",
           "odc-core `gpu::nvshmem`", "Path of NVSHMEM's host library (`libnvshmem_host.so.3`), or a folder "
           "holding it.", "gpu"),
    EnvVar("ODC_SITE_PACKAGES", "set by `import odc` to its interpreter's `site-packages`",
           "odc-kernels `wheels`; written by `odc/__init__.py`",
           "`:`-separated `site-packages` folders searched for the NVRTC and NVSHMEM wheels, before "
           "`$VIRTUAL_ENV`'s. Set it where the Rust test executables run beside another Python.", "gpu"),
    EnvVar("ODC_FD_SHARE", "`auto`", "odc-core `gpu::fdshare`",
           "How device-memory descriptors reach the peers (`cuda-ipc`): `auto` (`pidfd_getfd`, else a Unix socket), "
           "`pidfd`, or `socket` (needed where ranks run in separate pid namespaces).", "gpu"),
    EnvVar("ODC_EMU_JITTER_US", "0", "odc-core `plane::emu`; `odc.engine`",
           "`emu-ipc` / `emu-shmem`: the most an emulated stream sleeps before each copy, add and signal, in "
           "microseconds (a whole number), so that tests see a stream lag behind the host.", "gpu"),
    # -- Python --------------------------------------------------------------------------------------------------
    EnvVar("ODC_BACKEND_SCRATCH_MB", "16", "`odc.backend`",
           "The bound on the scratch shard per rank of the `odc` process group's engines, in MiB (positive; "
           "fractions allowed): the engines of a rank set are sized by its largest operation up to this bound, and "
           "larger operations are cut into pieces.", "python"),
    EnvVar("ODC_BACKEND_ELASTIC", "0", "`odc.backend` (`_elastic`)",
           "`1`: an `odc` process group's all-reduces (SUM, AVG, PREMUL_SUM; MAX, MIN, PRODUCT and the bitwise ops "
           "up to 1 MiB of every rank's tensors together; float and integer tensors), barrier and broadcast go on "
           "over the surviving nodes when a rank dies (elastic hybrid sharding's membership rounds; whole nodes of "
           "`LOCAL_WORLD_SIZE` ranks); every other operation still waits for every rank. Equal on every rank.",
           "python"),
    EnvVar("ODC_ALLOW_UNCHECKED_TORCH", "unset: a torch outside 2.11–2.15 is a `ConfigError`",
           "`odc.fsdp` (`_private`)",
           "`1` lets `odc.fsdp.enable` run on a torch newer than the checked range, with a warning; its private "
           "FSDP2 state is read as 2.15's.", "python"),
    EnvVar("ODC_VERL_BALANCE", "`lb-mini`", "`odc.integrations.verl_auto`",
           "How verl's engines on ODC split each minibatch across ranks: `lb-mini` (Karmarkar–Karp over every "
           "rank's samples, unequal microbatch counts) or `none` (verl's own split).", "python"),
    EnvVar("ODC_VERL_COST", "`verl`", "`odc.integrations.verl_auto`",
           "The cost model LB-Mini balances verl's samples with (any name `odc.packing` takes).", "python"),
    EnvVar("ODC_VERL_COMPRESS", "unset: nothing compressed", "`odc.integrations.verl_auto`",
           "The `compress=` setting verl's engines on ODC get, as JSON (e.g. "
           "`{\"gather\": \"fp8\", \"push\": \"int8\"}`); not JSON or a malformed setting is a ConfigError "
           "naming it.", "python"),
    EnvVar("ODC_BENCH_SPAWN", "unset: ranks fork from a server that imported torch once", "`odc.bench.launch`",
           "`1`: `odc-bench` starts each local rank as a fresh interpreter (for settings torch reads only at "
           "import).", "python"),
    EnvVar("ODC_BENCH_TRACEBACK", "unset", "`odc.bench.launch`",
           "Any value: a failed `odc-bench` rank's error carries its traceback.", "python"),
    # -- tests and harnesses -------------------------------------------------------------------------------------
    EnvVar("ODC_REQUIRE_GPU", "unset: GPU tests skip without a GPU",
           "odc-core and odc-kernels GPU tests; `odc-py/tests`",
           "`1`: a GPU test that finds no device fails instead of skipping (`scripts/gpu-run.sh` sets it).",
           "tests"),
    EnvVar("ODC_FUZZ_SCRATCH", "the system's temporary folder", "the `pack_input` fuzz target (`fuzz/`)",
           "Where the fuzz target writes the input files it hands `odc-pack`; `scripts/fuzz.sh` sets it to a "
           "folder of its own.", "tests"),
    EnvVar("ODC_REQUIRE_NVRTC", "unset", "odc-kernels `tests/cuda_compile.rs`",
           "`1`: the kernel-compile tests fail without NVRTC instead of skipping.", "tests"),
    EnvVar("ODC_REQUIRE_NVSHMEM", "unset", "odc-core `tests/nvshmem_bindings.rs`",
           "`1`: the NVSHMEM symbol and layout checks fail without the library instead of skipping.", "tests"),
    EnvVar("ODC_REQUIRE_CUDA_HEADERS", "unset", "odc-core `tests/cuda_driver_bindings.rs`",
           "`1`: the driver-binding check fails without `cuda.h` (or a C compiler) instead of skipping.", "tests"),
    EnvVar("ODC_REQUIRE_NETNS", "unset (`.ci/run` sets it)", "`odc-py/tests/_netns.py`",
           "`1`: a multi-host test that cannot make its network namespaces fails instead of skipping.", "tests"),
    EnvVar("ODC_REQUIRE_VERL", "unset (`make pytest-torch211` sets it)", "`odc-py/tests/test_integrations_verl.py`",
           "`1`: the verl tests fail where verl does not import instead of skipping.", "tests"),
    EnvVar("ODC_REQUIRE_HF", "unset (`make pytest` and `make pytest-torch211` set it)", "`odc-py/tests/_dist.py`",
           "`1`: the Hugging Face trainers' tests fail where TRL, accelerate or datasets is missing instead of "
           "skipping.", "tests"),
    EnvVar("ODC_TEST_SPAWN", "unset: test ranks fork from a server", "`odc-py/tests/_dist.py`, `_netns.py`",
           "`1`: every test rank is a fresh interpreter.", "tests"),
    EnvVar("ODC_ELASTIC_KILLS", "1", "`odc-py/tests/test_elastic.py`",
           "How many random-kill runs `test_random_kill_points` makes (the closing series: 20).", "tests"),
    EnvVar("ODC_ELASTIC_SEED", "0", "`odc-py/tests/test_elastic.py`",
           "The seed that picks those runs' victims, minibatches and kill points.", "tests"),
    EnvVar("ODC_REJOIN_KILLS", "1", "`odc-py/tests/test_rejoin.py`",
           "How many random kill-and-rejoin runs `test_random_kills_and_rejoins` makes (the closing series: 20).",
           "tests"),
    EnvVar("ODC_REJOIN_SEED", "0", "`odc-py/tests/test_rejoin.py`",
           "The seed that picks those runs' victims, minibatches and kill points.", "tests"),
    EnvVar("ODC_HARNESS_PROBE", "unset", "`odc-py/tests/test_harness.py`",
           "Set by the harness test to see that ranks inherit the test's environment.", "tests"),
    EnvVar("ODC_FDSHARE_TEST_ROLE", "unset", "odc-core `tests/fdshare.rs`",
           "The role of the child process the descriptor-passing test starts.", "tests"),
    EnvVar("ODC_FDSHARE_TEST_ARGS", "unset", "odc-core `tests/fdshare.rs`",
           "The arguments of that child process.", "tests"),
    EnvVar("ODC_TEST_NVSHMEM_PE", "unset", "odc-core `tests/gpu_engine.rs`",
           "The PE of a child process of the NVSHMEM engine test.", "tests"),
    EnvVar("ODC_TEST_NVSHMEM_STORE", "unset", "odc-core `tests/gpu_engine.rs`",
           "The file store of that child process.", "tests"),
    EnvVar("ODC_WHEELS_TEST_LIB_DIR", "unset", "odc-kernels `wheels` (unit test)",
           "A variable only the library-search test sets and reads.", "tests"),
    EnvVar("ODC_LOOM_BROKEN_NOTIFY", "unset", "odc-core `loom_model` (unit test)",
           "Set in the child process that runs the deliberately broken loom model.", "tests"),
    EnvVar("ODC_FAULT_SERVER_PANIC", "unset", "odc-core `server` (read at `register`)",
           "`RANK:N`: the shard server daemon of rank RANK panics as it is about to add the N-th chunk a peer "
           "pushed to it (N from 1), so that tests see a daemon's panic become an `InternalError` naming the "
           "rank (never an abort). A malformed value is a `ConfigError` at `register`.", "tests"),
    EnvVar("ODC_ALL_NS", "unset: rank 0 stays in the test's pid namespace", "`tests/tests/containers.rs`",
           "`1`: the containers test's launcher puts every rank in a pid namespace of its own.", "tests"),
    EnvVar("ODC_IN_SMALL_SHM", "unset", "`tests/tests/containers.rs`",
           "Set in the child that runs inside a 4 MiB `/dev/shm` mount namespace.", "tests"),
    # The test worker (tests/src/bin/odc-rank-worker.rs): one rank of a named scenario, configured by its test.
    EnvVar("ODC_RANK", "0", "`odc-rank-worker`", "The worker's rank (set by the harness).", "tests"),
    EnvVar("ODC_WORLD", "1", "`odc-rank-worker`", "The world size (set by the harness).", "tests"),
    EnvVar("ODC_LOCAL_WORLD", "the world", "`odc-rank-worker`",
           "Ranks per emulated node: ranks `[n*G, (n+1)*G)` form node `n`.", "tests"),
    EnvVar("ODC_STORE_DIR", "`/tmp/odc-store`", "`odc-rank-worker`", "The file store's folder.", "tests"),
    EnvVar("ODC_SCENARIO", "`train`", "`odc-rank-worker`", "The scenario the worker runs.", "tests"),
    EnvVar("ODC_DTYPE", "`f32`", "`odc-rank-worker`", "The parameter dtype.", "tests"),
    EnvVar("ODC_GRAD_DTYPE", "the parameter dtype", "`odc-rank-worker`", "The gradient dtype.", "tests"),
    EnvVar("ODC_NUMELS", "one bucket", "`odc-rank-worker`", "Bucket sizes, comma separated.", "tests"),
    EnvVar("ODC_NUMEL", "262144", "`odc-rank-worker`", "The bucket size of the version scenarios.", "tests"),
    EnvVar("ODC_VERSIONS", "20", "`odc-rank-worker`", "Versions the version scenarios publish.", "tests"),
    EnvVar("ODC_MINIBATCHES", "2", "`odc-rank-worker`", "Minibatches to run.", "tests"),
    EnvVar("ODC_MICRO", "1 per rank", "`odc-rank-worker`", "Microbatches per rank, comma separated.", "tests"),
    EnvVar("ODC_CHUNK", "the engine's", "`odc-rank-worker`", "Landing-slot bytes.", "tests"),
    EnvVar("ODC_JITTER", "off", "`odc-rank-worker`", "`1`: random sleeps between operations.", "tests"),
    EnvVar("ODC_CRASH_RANK", "none", "`odc-rank-worker`", "The rank that crashes.", "tests"),
    EnvVar("ODC_CRASH_AT", "never", "`odc-rank-worker`",
           "Where it crashes: `after_register`, `before_finish`, `before_publish`.", "tests"),
    EnvVar("ODC_CRASH_MINIBATCH", "0", "`odc-rank-worker`", "The minibatch it crashes in.", "tests"),
    EnvVar("ODC_STALL", "off", "`odc-rank-worker`", "`1`: the crash rank sleeps instead of aborting.", "tests"),
    EnvVar("ODC_STALL_S", "4", "`odc-rank-worker`", "How long it sleeps, in seconds.", "tests"),
    EnvVar("ODC_BAD_RANK", "1", "`odc-rank-worker`", "The rank that registers a different bucket list.", "tests"),
    EnvVar("ODC_EXPECT_ERROR", "off", "`odc-rank-worker`",
           "`1`: an engine error is the expected outcome (exit code 10).", "tests"),
)
"""The table, in the configuration page's order."""
