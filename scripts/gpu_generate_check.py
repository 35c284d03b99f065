"""`tessera generate --device cuda` against transformers' own greedy tokens: the GPT-2 and LLaMA
fixtures (crates/tessera-cli/tests/fixtures/hf/*/generate.json, made by transformers), on one
device and on two devices sharing the GPU. Prints one JSON line per run; exits 1 on a mismatch.

    python3 scripts/gpu_generate_check.py      # TESSERA_CLI=target/release/tessera
"""
import json, os, subprocess, sys

CLI = os.environ.get("TESSERA_CLI", "target/release/tessera")
ok_all = True
for name, n in [("gpt2", 1), ("llama", 1), ("gpt2", 2)]:
    fx = f"crates/tessera-cli/tests/fixtures/hf/{name}"
    want = json.load(open(f"{fx}/generate.json"))
    cmd = [CLI, "generate", "--device", "cuda", "--devices", str(n), "--model-dir", fx,
           "--max-new-tokens", str(want["max_new_tokens"]), "--format", "json"]
    for p in want["prompts"]:
        cmd += ["--tokens", ",".join(map(str, p))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    got = json.loads(r.stdout) if r.returncode == 0 else {}
    ok = got.get("new_tokens") == want["new_tokens"]
    ok_all &= ok
    print(json.dumps({"check": "cli_generate", "model": name, "devices": n, "tokens_equal": ok,
                      "decode_tokens_per_s": got.get("decode_tokens_per_s"),
                      "error": r.stderr[-500:] if r.returncode else None, "ok": ok}), flush=True)
sys.exit(0 if ok_all else 1)
