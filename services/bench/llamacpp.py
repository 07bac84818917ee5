"""`strata bench llamacpp`: llama.cpp's `llama-server` on a Strata checkpoint, as issue #9's baseline.

Reproducible from one pinned source, the llama-cpp-python sdist (it vendors llama.cpp):
  build    `pip download` the sdist, build only the `llama-server` target with cmake (CPU only,
           `-march=native`, `nice -n 19`, one compile job at a time), keep the binary under
           ~/.cache/strata/llamacpp/<version>/ (built once per machine).
  convert  a Strata/HF checkpoint directory to GGUF (f32, bf16, or q8_0: llama.cpp's 8-bit weights, what its
           CPU users run) with the vendored
           `convert_hf_to_gguf.py` and the vendored `gguf-py` it was released with.
  serve    build + convert, then start `llama-server` on the GGUF and wait until /health answers;
           runs until interrupted. Point `strata bench serve --baseline-url` at it.

The tokenizer: llama.cpp picks its BPE pre-tokenizer by hashing how the tokenizer splits a fixed
text and rejects a hash it does not know. Strata's built-in tokenizer is byte-level BPE whose
pre-tokenizer splits like GPT-2's (`ByteLevel` with the GPT-2 regex), so the conversion names
that pre-tokenizer ("gpt-2") for an unknown hash instead of failing; `verify_pre_tokenizer`
checks the claim on the tokenizer itself before converting.
"""

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.common.supervisor import die_with_parent

VERSION = "0.3.36"
CACHE_DIR = Path.home() / ".cache" / "strata" / "llamacpp"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "q8_0": "q8_0"}
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_CCACHE=OFF")


def version_dir(version: str = VERSION) -> Path:
    return CACHE_DIR / version


def source_dir(version: str = VERSION) -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, downloaded and unpacked once."""
    root = version_dir(version) / f"llama_cpp_python-{version}"
    if not root.is_dir():
        version_dir(version).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", tmp], check=True)
            with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as sdist:
                sdist.extractall(version_dir(version), filter="data")
    return root / "vendor" / "llama.cpp"


def build_server(version: str = VERSION) -> Path:
    """The `llama-server` binary of `version`, built here on first use (minutes, niced, serial)."""
    binary = version_dir(version) / "llama-server"
    if binary.is_file():
        return binary
    source, build = source_dir(version), version_dir(version) / "build"
    nice = ["nice", "-n", "19"]
    subprocess.run([*nice, "cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True)
    subprocess.run([*nice, "cmake", "--build", str(build), "--target", "llama-server", "-j", "1"], check=True)
    shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "use_regex": True}
# Run in the converter's own process: an unknown pre-tokenizer hash means "gpt-2" (checked beforehand).
_CONVERT = """
import runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
from conversion.base import TextModel
recognise = TextModel.get_vocab_base_pre
def gpt2_when_unknown(self, tokenizer):
    try:
        return recognise(self, tokenizer)
    except NotImplementedError:
        print("llamacpp: unknown BPE pre-tokenizer hash; tokenizer.json splits like GPT-2, writing 'gpt-2'")
        return "gpt-2"
TextModel.get_vocab_base_pre = gpt2_when_unknown
runpy.run_path(script, run_name="__main__")
"""


def verify_pre_tokenizer(model_dir: Path) -> None:
    """Raises unless the checkpoint's tokenizer pre-tokenizes as GPT-2 does (byte-level with GPT-2's
    regex, no normalizer), which is what naming llama.cpp's "gpt-2" pre-tokenizer claims."""
    import json

    spec = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") or any(pre.get(key) != value for key, value in GPT2_PRE_TOKENIZER.items()):
        raise ValueError(f"{model_dir}/tokenizer.json does not pre-tokenize as GPT-2 (pre_tokenizer {pre}, "
                         f"normalizer {spec.get('normalizer')}); llama.cpp's 'gpt-2' pre-tokenizer would not match it")


def convert_to_gguf(model_dir: Path, dtype: str, version: str = VERSION) -> Path:
    """`model_dir` as GGUF of `dtype` (float32, bfloat16 or q8_0), written beside it once:
    `<model_dir>/ggml-model-<f32|bf16|q8_0>.gguf`."""
    out = Path(model_dir) / f"ggml-model-{GGUF_TYPES[dtype]}.gguf"
    if out.is_file():
        return out
    verify_pre_tokenizer(model_dir)
    source = source_dir(version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), str(source / "gguf-py")]))
    subprocess.run([sys.executable, "-c", _CONVERT, str(source / "convert_hf_to_gguf.py"), str(model_dir),
                    "--outtype", GGUF_TYPES[dtype], "--outfile", str(out)], check=True, env=env)
    return out


def server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int) -> list[str]:
    """`llama-server` as the baseline runs: `parallel` slots of `ctx_per_slot` tokens each, continuous
    batching, `threads` threads for generation and for prompt processing."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--cont-batching",
            "--metrics", "--no-ui"]


def wait_healthy(process: subprocess.Popen, port: int, timeout_s: float = 300.0) -> None:
    """Returns once `llama-server` answers /health with 200 (model loaded); raises if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server on port {port} not healthy after {timeout_s:.0f}s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("build", "convert", "serve"),
                   help="build: llama-server from the sdist; convert: also the checkpoint to GGUF; serve: also "
                        "start llama-server on it")
    p.add_argument("--model", default=None, help="Strata/HF checkpoint directory (convert, serve; required there)")
    p.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES), help="GGUF weights (default: %(default)s)")
    p.add_argument("--port", type=int, default=8081, help="llama-server's port (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="-t and -tb of llama-server (default: %(default)s)")
    p.add_argument("--parallel", type=int, default=64, help="slots, i.e. concurrent streams (default: %(default)s)")
    p.add_argument("--ctx-per-slot", type=int, default=1024,
                   help="context per slot; -c is parallel x this (default: %(default)s, fits 512 + 256 tokens)")
    p.add_argument("--server-args", default="",
                   help="more llama-server flags, one quoted string (e.g. \"-ctk f32 -ctv f32\": its K/V cache is f16 "
                        "by default)")
    p.add_argument("--version", default=VERSION, help="llama-cpp-python sdist to build from (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    binary = build_server(args.version)
    print(f"llama-server: {binary}", flush=True)
    if args.action == "build":
        return 0
    if not args.model:
        raise SystemExit(f"strata bench llamacpp {args.action}: --model DIR is required")
    gguf = convert_to_gguf(Path(args.model), args.dtype, args.version)
    print(f"gguf: {gguf}", flush=True)
    if args.action == "convert":
        return 0
    command = server_command(binary, gguf, args.port, args.threads, args.parallel, args.ctx_per_slot)
    command += shlex.split(args.server_args)
    print(" ".join(command), flush=True)
    return serve(command, args.port)


def serve(command: list[str], port: int) -> int:
    """Runs the server until it exits, or until Ctrl-C or SIGTERM, which stop it (SIGTERM, then SIGKILL
    after 30 s); it also gets SIGTERM if this process dies. A shell starting this in the background
    leaves SIGINT ignored, so both signals are handled here explicitly."""
    def stop(signum, _frame) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    process = subprocess.Popen(command, preexec_fn=die_with_parent)
    try:
        wait_healthy(process, port)
        print(f"llama-server healthy on http://127.0.0.1:{port} (Ctrl-C stops it)", flush=True)
        process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0 if process.returncode in (0, -signal.SIGTERM) else process.returncode
