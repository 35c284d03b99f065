"""Compiles the CUDA backend's kernels on a machine without a GPU: NVRTC for sm_90 (what
`Gpu::open` does on an H100/H200), then `ptxas -v` for each kernel's registers, spills and
shared memory. Catches compile errors and register/spill regressions before device time is
spent. Needs NVRTC and ptxas from PyPI:

    python3 -m venv /tmp/nv && /tmp/nv/bin/pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
    /tmp/nv/bin/python scripts/cuda-compile-check.py [name-substring ...]

Prints one line per kernel (filtered by the substrings given) and exits non-zero when NVRTC
or ptxas fails.
"""
import ctypes, glob, os, subprocess, sys, tempfile

SOURCES = ["kernels.cu", "reduce.cu", "layers.cu", "flash.cu", "vision.cu", "infer.cu", "moe.cu",
           "ring.cu"]  # source::KERNELS, in order

def main():
    import nvidia
    base = nvidia.__path__[0]
    nvrtc = ctypes.CDLL(glob.glob(os.path.join(base, "cuda_nvrtc", "lib", "libnvrtc.so.*"))[0])
    ptxas = os.path.join(base, "cuda_nvcc", "bin", "ptxas")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "tessera-cuda", "src")
    src = "".join(open(os.path.join(root, f)).read() for f in SOURCES).encode()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"tessera.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode())
    if rc != 0:
        sys.exit(f"NVRTC failed ({rc})")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        open(path, "wb").write(ptx.value)
        out = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    want, cur, info = sys.argv[1:], None, {}
    for line in out.stderr.splitlines():
        if "Compiling entry function" in line:
            cur = line.split("'")[1]
        elif cur and ("registers" in line or "spill" in line):
            info.setdefault(cur, []).append(line.split(":", 1)[-1].strip())
    for name in sorted(info):
        if not want or any(w in name for w in want):
            print(f"{name}: {'; '.join(info[name])}")
    if out.returncode != 0:
        sys.exit("ptxas failed:\n" + out.stderr[-3000:])

if __name__ == "__main__":
    main()
