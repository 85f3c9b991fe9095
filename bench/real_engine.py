"""Build llama.cpp's ``llama-server`` and a tiny random-weight model, cached.

Why: the tests and benchmarks need a real inference engine on machines with
no GPU and no model hub. The only source allowed is the package registries,
so the C++ sources come from the ``llama-cpp-python`` sdist on PyPI and the
model is written locally with the ``gguf`` package, using the vocab-only
GGUF that ships in that sdist for its tokenizer.

The binary is built with ``GGML_NATIVE=ON`` (fast on this CPU, possibly
illegal instructions on another), so the cache key includes the CPU's model
and flags: another machine gets its own build. Everything lives under the
cache folder (``ADMISSION_PROXY_ENGINE_CACHE`` or
``~/.cache/admission-proxy/llama.cpp``); nothing built is committed.

Usage: ``scripts/real-engine [--jobs N]`` builds what is missing and prints
the paths as ``SERVER=...``, ``MODEL=...`` and ``KNEE_MODEL=...`` lines.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SDIST_VERSION = "0.3.36"
VOCAB_FILE = "ggml-vocab-llama-spm.gguf"
# Two layers of 64 wide: 5 MB, loads in ~0.15 s, ~1-5k tokens/s on one core.
MODEL_SHAPE = {"layers": 2, "embd": 64, "heads": 4, "ff": 128, "ctx": 16384}
# For finding a knee: 120 MB of F32 weights, far more than the CPU's caches,
# so each decode step is bound by reading them, as on a GPU, and a batch of 4
# costs little more than one: throughput 5.1, 7.6, 9.6, 11.7 req/s at 1 to 4
# sequences on two cores, flat after, and p99 up 1.7x at 4 but 3.5x at 6.
# The tiny model sits in cache and is compute-bound: latency doubles by 2 or 3
# sequences and the staircase's "p99 over twice the first" line fires early.
KNEE_MODEL_SHAPE = {"layers": 4, "embd": 512, "heads": 8, "ff": 1536, "ctx": 16384, "f32": 1}
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # Both default to fetching a web UI over the network at build time.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' "
    "+ message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class MissingToolchain(RuntimeError):
    """The machine cannot compile llama.cpp (no cmake or no C++ compiler)."""


@dataclass(frozen=True)
class Engine:
    server: Path
    model: Path
    #: A larger random model whose batching gains make a clear knee (staircase tests).
    knee_model: Path


def cache_root() -> Path:
    env = os.environ.get("ADMISSION_PROXY_ENGINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "admission-proxy" / "llama.cpp"


def cpu_key() -> str:
    """A short id of this CPU's model and instruction-set flags."""
    ident = platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("model name", "flags", "Features"):
            ident += "|" + value.strip()
        if name.strip() in ("flags", "Features"):
            break  # the first processor describes them all
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def missing_tools() -> list[str]:
    return [tool for tool in ("cmake", "c++", "cc") if shutil.which(tool) is None]


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """One builder at a time per cache folder (parallel test runs share it)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _log(message: str) -> None:
    print(f"[real-engine] {message}", file=sys.stderr, flush=True)


def source_tree(root: Path) -> Path:
    """The sdist's ``vendor/llama.cpp``, downloaded and unpacked once."""
    unpacked = root / f"llama_cpp_python-{SDIST_VERSION}"
    tree = unpacked / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    sdists = root / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    archive = next(sdists.glob(f"llama_cpp_python-{SDIST_VERSION}.tar.gz"), None)
    if archive is None:
        _log(f"downloading llama-cpp-python=={SDIST_VERSION} sdist from PyPI (~77 MB)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"llama-cpp-python=={SDIST_VERSION}",
                "-d",
                str(sdists),
            ],
            check=True,
        )
        archive = next(sdists.glob("llama_cpp_python-*.tar.gz"))
    _log(f"unpacking {archive.name}")
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    if not (tree / "CMakeLists.txt").exists():
        raise RuntimeError(f"{archive} has no vendor/llama.cpp/CMakeLists.txt")
    return tree


def build_server(root: Path, tree: Path, jobs: int) -> Path:
    out = root / f"server-{SDIST_VERSION}-{cpu_key()}"
    binary = out / "llama-server"
    if binary.exists():
        return binary
    missing = missing_tools()
    if missing:
        raise MissingToolchain(f"cannot build llama-server: {', '.join(missing)} not found")
    build = root / f"build-{cpu_key()}"
    started = time.monotonic()
    _log(f"building llama-server with {jobs} jobs (about 7 minutes on 2 cores)")
    log_path = root / f"build-{cpu_key()}.log"
    with open(log_path, "w") as log:
        for step in (
            ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS],
            ["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"],
        ):
            # Compiler warnings run to thousands of lines: into the log, not the terminal.
            done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, check=False)
            if done.returncode:
                tail = log_path.read_text(errors="replace").splitlines()[-30:]
                raise RuntimeError(
                    f"{' '.join(step[:2])} failed ({done.returncode}); log {log_path}:\n"
                    + "\n".join(tail)
                )
    built = next(build.rglob("bin/llama-server"))
    out.mkdir(parents=True, exist_ok=True)
    # Copy then rename: a half-written binary never looks finished.
    shutil.copy2(built, out / "llama-server.tmp")
    os.replace(out / "llama-server.tmp", binary)
    shutil.rmtree(build, ignore_errors=True)
    _log(f"built {binary} in {time.monotonic() - started:.0f} s")
    return binary


def write_model(root: Path, tree: Path, shape: dict[str, int] | None = None) -> Path:
    """A random-weight llama model with the real SPM tokenizer."""
    shape = shape or MODEL_SHAPE
    tag = hashlib.sha256(repr(sorted(shape.items())).encode()).hexdigest()[:8]
    path = root / f"tiny-llama-{tag}.gguf"
    if path.exists():
        return path
    # Only the model writer needs these (dev dependencies).
    import gguf
    import numpy as np

    vocab = gguf.GGUFReader(str(tree / "models" / VOCAB_FILE))

    def field(name: str) -> gguf.ReaderField:
        found = vocab.get_field(name)
        if found is None:
            raise RuntimeError(f"{VOCAB_FILE} has no {name}")
        return found

    def strings(name: str) -> list[str]:
        f = field(name)
        return [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]

    def numbers(name: str) -> list[float]:
        f = field(name)
        return [f.parts[i][0].item() for i in f.data]

    def scalar(name: str) -> int:
        f = field(name)
        return int(f.parts[f.data[0]][0])

    tokens = strings("tokenizer.ggml.tokens")
    n_vocab = len(tokens)
    layers, embd, heads, ff = (shape[k] for k in ("layers", "embd", "heads", "ff"))
    writer = gguf.GGUFWriter(str(path) + ".tmp", arch="llama")
    writer.add_name("admission-proxy tiny random llama")
    writer.add_context_length(shape["ctx"])
    writer.add_embedding_length(embd)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(embd // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(n_vocab)
    f32 = bool(shape.get("f32"))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre(
        strings("tokenizer.ggml.pre")[0] if vocab.get_field("tokenizer.ggml.pre") else "default"
    )
    writer.add_token_list(tokens)
    writer.add_token_scores(numbers("tokenizer.ggml.scores"))
    writer.add_token_types([int(x) for x in numbers("tokenizer.ggml.token_type")])
    writer.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(scalar("tokenizer.ggml.unknown_token_id"))
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)

    rng = np.random.default_rng(20261130)

    def weight(*dims: int) -> np.ndarray[Any, Any]:
        return (rng.standard_normal(dims) * 0.02).astype(np.float32 if f32 else np.float16)

    def norm(size: int) -> np.ndarray[Any, Any]:
        return np.ones(size, dtype=np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, embd))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm(embd))
        for part in ("q", "k", "v", "output"):
            writer.add_tensor(f"blk.{i}.attn_{part}.weight", weight(embd, embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm(embd))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ff, embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(ff, embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(embd, ff))
    writer.add_tensor("output_norm.weight", norm(embd))
    # No output.weight: tied to the embedding, whose small spread keeps the
    # random model from emitting only newlines.
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # A new file, never an overwrite: a running server memory-maps the old one.
    os.replace(str(path) + ".tmp", path)
    return path


def ensure(jobs: int | None = None) -> Engine:
    """Build whatever is missing; return the server binary and model paths."""
    root = cache_root()
    with locked(root):
        tree = source_tree(root)
        server = build_server(root, tree, jobs or os.cpu_count() or 2)
        model = write_model(root, tree)
        knee_model = write_model(root, tree, KNEE_MODEL_SHAPE)
    return Engine(server=server, model=model, knee_model=knee_model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    args = parser.parse_args()
    try:
        engine = ensure(args.jobs)
    except MissingToolchain as exc:
        print(f"real-engine: {exc}", file=sys.stderr)
        return 3
    print(f"SERVER={engine.server}")
    print(f"MODEL={engine.model}")
    print(f"KNEE_MODEL={engine.knee_model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
