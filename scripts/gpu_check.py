"""The device check: one script, one GPU, at most ~4 minutes, a JSON report that grows
section by section (a run cut at its time limit still reports what it measured).

    python scripts/gpu_check.py                 # on the GPU; report in $OUT (or --out)
    python scripts/gpu_check.py --dry-run       # on CPU, toy sizes: checks the script

Sections, in priority order (each records its own error and the check goes on):
  env        torch / GPU / pcpflow versions
  hardware   measured bf16 (and fp8) GEMM TFLOP/s, HBM TB/s, flash-attention TFLOP/s,
             also written as a hardware profile (conf/hardware/*.yaml's fields)
  profile    `python -m pcpflow mode=profile pcp=1` on the GPU (<= 90 s): GEMMs, attention
             (fused), memory, launch and graph replay, pcpflow's host work; its collectives
             stay priced by NCCL's model (from: h200_sxm); a cut profile is kept, partial
  attention  fused vs reference paged attention at a real shape (and through a 1024-key window, 2048-key chunks): max |diff|, time
  runs       pcp=1 bf16 engine runs (<= 120 s): tiny models, then a random-weight model at
             Llama-3-8B dims (a few layers) at 8K and 32K prompts; eager vs CUDA graphs
             (cudagraph_mode=full_decode_only, attention=fused): TTFT, TPOT, speed-up,
             graphs' tokens and logits against the eager reference (verify)
  predict    each Llama run simulated on the measured profile (mode=simulate
             hardware=measured): predicted vs executed TTFT and TPOT, with the error
  roofline   each Llama run's decode step and prefill vs the HBM and FLOP limits measured
             in `hardware`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

REPORT = "gpu_check.json"
PROFILE = "hardware_measured.yaml"
PROFILE_CAP_S, RUNS_CAP_S = 90.0, 120.0

LLAMA3_8B = {  # Llama-3-8B's shape; few layers, random weights
    "hidden_size": 4096,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
}


class Skip(Exception):
    """A section that has nothing to work on (an earlier one was skipped or failed)."""


class Check:
    def __init__(self, out: Path, dry_run: bool, budget_s: float) -> None:
        self.out, self.dry, self.budget_s = out, dry_run, budget_s
        self.t0 = time.perf_counter()
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.report: dict = {
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "dry_run": dry_run,
            "sections": {},
        }

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.out / (REPORT + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        tmp.replace(self.out / REPORT)

    def section(self, name: str, fn, *, needs_s: float = 0.0) -> None:
        entry = self.report["sections"].setdefault(name, {})
        if self.left_s() < needs_s:
            entry["status"] = f"skipped: {self.left_s():.0f} s left, needs ~{needs_s:.0f} s"
            self.write()
            return
        t = time.perf_counter()
        entry["status"] = "running"
        self.write()
        try:
            fn(entry)
            entry["status"] = "ok"
        except Skip as why:
            entry["status"] = f"skipped: {why}"
        except Exception as exc:  # the check goes on: one section's failure is a finding
            entry["status"] = "failed"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=8)
        entry["section_s"] = round(time.perf_counter() - t, 2)
        self.write()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn, repeat: int) -> float:
        """Median seconds of ``fn()`` over ``repeat`` runs, after one warm-up."""
        fn()
        self.sync()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    # ------------------------------------------------------------------ sections
    def env(self, e: dict) -> None:
        import pcpflow

        e["torch"] = torch.__version__
        e["python"] = sys.version.split()[0]
        e["pcpflow"] = str(Path(pcpflow.__file__).parent)
        e["cuda_available"] = torch.cuda.is_available()
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(0)
            e.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
            e["cuda"] = torch.version.cuda
        for mod in ("hydra", "omegaconf", "pydantic"):
            e[mod] = getattr(__import__(mod), "__version__", "?")

    def hardware(self, e: dict) -> None:
        dev, bf16 = self.device, torch.bfloat16
        n = 256 if self.dry else 8192
        a, b = torch.randn(n, n, device=dev, dtype=bf16), torch.randn(n, n, device=dev, dtype=bf16)
        s = self.timed(lambda: a @ b, 1 if self.dry else 20)
        e["gemm_bf16_tflops"] = 2 * n**3 / s / 1e12
        e["gemm_shape"] = [n, n, n]
        if dev.type == "cuda" and hasattr(torch, "float8_e4m3fn"):
            try:
                a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().t().to(torch.float8_e4m3fn)
                one = torch.ones((), device=dev)
                s8 = self.timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=bf16), 20)
                e["gemm_fp8_tflops"] = 2 * n**3 / s8 / 1e12
            except Exception as exc:  # fp8 GEMM entry points move between torch versions
                e["gemm_fp8_error"] = f"{type(exc).__name__}: {exc}"
        nbytes = (8 << 20) if self.dry else (4 << 30)
        x = torch.empty(nbytes // 2, device=dev, dtype=bf16)
        y = torch.empty_like(x)
        s = self.timed(lambda: y.copy_(x), 3 if self.dry else 20)
        e["hbm_copy_bytes"] = nbytes
        e["hbm_tbps"] = 2 * nbytes / s / 1e12  # a copy reads and writes every byte
        bsz, h, seq, d = (1, 4, 256, 64) if self.dry else (4, 32, 8192, 128)
        q = torch.randn(bsz, h, seq, d, device=dev, dtype=bf16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        s = self.timed(lambda: sdpa(q, k, v, is_causal=True), 3 if self.dry else 10)
        e["attention_bf16_tflops"] = 4 * bsz * h * seq * seq * d / 2 / s / 1e12  # causal: half
        e["attention_shape"] = [bsz, h, seq, d]
        profile = {
            "name": "measured_" + (e.get("gpu_name") or self._gpu_slug()),
            "measured": self.report["started"],
            "hbm_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if dev.type == "cuda" else None,
            "hbm_tbps": round(e["hbm_tbps"], 3),
            "peak_tflops": {"bf16": round(e["gemm_bf16_tflops"], 1)},
            "attention_tflops": {"bf16": round(e["attention_bf16_tflops"], 1)},
        }
        if "gemm_fp8_tflops" in e:
            profile["peak_tflops"]["fp8"] = round(e["gemm_fp8_tflops"], 1)
        e["hardware_profile"] = profile
        (self.out / PROFILE).write_text(_yaml(profile))

    def _gpu_slug(self) -> str:
        if self.device.type != "cuda":
            return "cpu"
        return torch.cuda.get_device_name(0).lower().replace(" ", "_").replace("nvidia_", "")

    def attention(self, e: dict) -> None:
        from pcpflow.attention.fused import fused_paged_attention
        from pcpflow.attention.paged import paged_attention
        from pcpflow.models.layers import gqa_spec, mla_spec

        ctx_len, chunk, decodes = (40, 16, 2) if self.dry else (8192, 2048, 16)
        specs = {
            "gqa_llama3_8b": gqa_spec(32, 8, 128) if not self.dry else gqa_spec(4, 2, 16),
            "mla_16_heads": mla_spec(16, 512, 64, 0.07) if not self.dry else mla_spec(4, 32, 8, 0.1),
            # a sliding layer's window (Gemma 3's 1024; the dry run's 8): each row's first key
            "gqa_window_1024": gqa_spec(32, 16, 128) if not self.dry else gqa_spec(4, 2, 16),
            # a chunked layer's chunk (Llama 4's attention_chunk_size is 8192; 2048 cuts this context)
            "gqa_chunked_2048": gqa_spec(40, 8, 128) if not self.dry else gqa_spec(4, 2, 16),
        }
        windows = {"gqa_window_1024": 8 if self.dry else 1024}
        chunks = {"gqa_chunked_2048": 8 if self.dry else 2048}
        dtype = torch.bfloat16
        for name, spec in specs.items():
            args = _paged_case(spec, ctx_len, chunk, decodes, 16, self.device, dtype)
            ctx = args[5]
            starts = (ctx - windows[name]).clamp(min=0) if name in windows else torch.zeros_like(ctx)
            if name in chunks:  # NOTE: the row at position ctx - 1 starts at its chunk's first key
                starts = (ctx - 1) - (ctx - 1) % chunks[name]
            args = (*args, starts) if name in windows or name in chunks else args
            out_r, lse_r = paged_attention(*args)
            out_f, lse_f = fused_paged_attention(*args)
            reps = 1 if self.dry else 3
            t_ref = self.timed(lambda: paged_attention(*args), reps)
            t_fused = self.timed(lambda: fused_paged_attention(*args), reps)
            pairs = int((ctx - starts).sum())
            e[name] = {
                "rows": chunk + decodes,
                "context": ctx_len,
                "max_abs_out_diff": float((out_f.float() - out_r.float()).abs().max()),
                "max_abs_lse_diff": float((lse_f - lse_r).abs().max()),
                "reference_s": t_ref,
                "fused_s": t_fused,
                "speedup": t_ref / t_fused,
                "fused_tflops": 2 * pairs * spec.num_heads * (spec.qk_dim + spec.v_dim) / t_fused / 1e12,
            }
            self.write()

    def profile(self, e: dict) -> None:
        """``mode=profile`` on this device, as a user runs it, cut at its cap (SIGINT: it keeps
        what it measured, partial). One GPU: no collective to measure; NCCL's model prices them
        with the graphs of ``profile.collectives_from`` (``from:`` in the file)."""
        import signal
        import subprocess

        import yaml

        run = self.out / "profile"
        cmd = [sys.executable, "-m", "pcpflow", "mode=profile", "pcp=1", f"device={self.device.type}",
               f"hydra.run.dir={run}", "output.progress=false"]
        if self.dry:  # the dry runs are float64 with the fused kernel: profile what they run
            cmd += ["profile.quick=true", "profile.dtypes=[float64]", "pipeline.forward.attention=fused"]
        cap = min(PROFILE_CAP_S, max(self.left_s() - 5, 1))
        e["command"] = " ".join(cmd[1:])
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=cap)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
            e["cut_at_s"] = cap
        e["exit_code"] = proc.returncode
        e["stderr_tail"] = err[-2000:]
        path = run / "hardware.yaml"
        if not path.exists():
            raise RuntimeError(f"no profile written (exit {proc.returncode}): {err[-500:]}")
        doc = yaml.safe_load(path.read_text())
        m = doc.get("measured") or {}
        e.update(path=str(path), profile_status=m.get("status"), missing=m.get("missing"), measured_s=m.get("section_s"),
                 peak_tflops=doc.get("peak_tflops"), hbm_tbps=doc.get("hbm_tbps"), host=doc.get("host"),
                 collectives_from=(doc.get("nvlink") or {}).get("from"))
        if proc.returncode not in (0, 130):
            raise RuntimeError(f"mode=profile exited {proc.returncode}")

    def predict(self, e: dict) -> None:
        """Each executed Llama run of ``runs`` priced on the measured profile: predicted vs
        executed TTFT and TPOT (error = predicted / executed - 1)."""
        from pcpflow.simulate.engine import simulate_run
        from pcpflow.testing import compose

        prof = self.report["sections"].get("profile", {})
        if prof.get("profile_status") != "complete":
            raise Skip(f"needs a complete profile (profile: {prof.get('profile_status') or prof.get('status')})")
        runs = self.report["sections"].get("runs", {})
        for key, r in runs.items():
            if not key.startswith("llama3_8b_dims/") or "ttft_s" not in r:
                continue
            over = [o for o in r["overrides"] if not o.startswith(("device=", "verify="))]
            try:
                sim = simulate_run(compose([*over, "mode=simulate", "hardware=measured", f"hardware.path={prof['path']}",
                                            "verify=false"]))
            except Exception as exc:  # one run's failure is a finding; the others go on
                e[key] = {"error": f"{type(exc).__name__}: {exc}"}
                self.write()
                continue
            m = sim["metrics"]
            row = {"executed_ttft_s": r["ttft_s"], "predicted_ttft_s": m["ttft"]["mean_s"],
                   "executed_tpot_s": r["tpot_s"], "predicted_tpot_s": m["tpot"]["mean_s"],
                   "breakdown_s": {k: v["exposed_s"] for k, v in m["simulate"]["breakdown_s"].items()}}
            for k in ("ttft", "tpot"):
                ex, pr = row[f"executed_{k}_s"], row[f"predicted_{k}_s"]
                row[f"{k}_error"] = pr / ex - 1 if ex and pr else None
            e[key] = row
            self.write()

    def runs(self, e: dict) -> None:
        started = time.perf_counter()
        cap = lambda: RUNS_CAP_S - (time.perf_counter() - started)  # noqa: E731
        tiny = ["tiny_gqa"] if self.dry else ["tiny_gqa", "tiny_mla"]
        prompts = (12, 5) if self.dry else (512, 300)
        for model in tiny:
            for mode in ("none", "full_decode_only"):
                self._run(e, f"{model}/{mode}", [f"model={model}"], list(prompts), 4 if self.dry else 32, mode)
        # attention sinks and a chunked layer through the CUDA-graph decode kernel (gpt-oss's, Llama 4's)
        sunk = ["model=tiny_gqa", "model.sinks=true", f"model.window={4 if self.dry else 128}",
                "model.window_kind=chunked", "model.window_layers=[0]"]
        for mode in ("none", "full_decode_only"):
            self._run(e, f"tiny_gqa_sinks_chunked/{mode}", sunk, list(prompts), 4 if self.dry else 32, mode)
        dims = dict(LLAMA3_8B)
        if self.dry:
            dims.update(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=512)
        llama = ["model=tiny_gqa", "model.num_layers=2"] + [f"model.{k}={v}" for k, v in dims.items()]
        for prompt in (40,) if self.dry else (8192, 32768):
            for mode in ("none", "full_decode_only"):
                need = 5 if self.dry else (25 if prompt <= 8192 else 45)
                if min(self.left_s(), cap()) < need:
                    e[f"llama3_8b_dims/{prompt}/{mode}"] = {"status": f"skipped: {min(self.left_s(), cap()):.0f} s left"}
                    continue
                self._run(e, f"llama3_8b_dims/{prompt}/{mode}", llama, [prompt], 4 if self.dry else 64, mode)
        for key in [k for k in e if k.endswith("/full_decode_only")]:
            eager, graphs = e.get(key.replace("full_decode_only", "none"), {}), e[key]
            if "tpot_s" in eager and "tpot_s" in graphs and graphs["tpot_s"]:
                graphs["tpot_speedup_vs_eager"] = eager["tpot_s"] / graphs["tpot_s"]
                graphs["decode_step_speedup_vs_eager"] = eager["decode_step_p50_s"] / graphs["decode_step_p50_s"]
                graphs["same_tokens_as_eager"] = eager.get("outputs") == graphs.get("outputs")

    def _run(self, e: dict, key: str, model: list[str], prompts: list[int], out_len: int, mode: str) -> None:
        from pcpflow.rank.engine import run_rank
        from pcpflow.testing import compose

        _share_models()

        longest = max(prompts) + out_len
        budget = min(8192, sum(prompts))
        overrides = model + [
            "pcp=1",
            # NOTE: the dry run checks the script: float64 leaves no near-tie between
            # eager and graphs; on the GPU the runs are bf16.
            f"dtype={'float64' if self.dry else 'bfloat16'}",
            f"device={self.device.type}",
            "workload=explicit",
            f"workload.prompt_lens=[{','.join(map(str, prompts))}]",
            f"workload.output_lens=[{','.join([str(out_len)] * len(prompts))}]",
            f"scheduler.max_num_batched_tokens={budget}",
            f"scheduler.max_num_seqs={max(2, len(prompts))}",
            f"kv.num_blocks={len(prompts) * (-(-longest // 16) + 1)}",
            f"cudagraph_mode={mode}",
            "pipeline.forward.attention=fused",
            f"verify={'true' if mode != 'none' else 'false'}",  # graphs vs the eager reference
            "output.plots=false",
            "output.progress=false",
        ]
        entry = e.setdefault(key, {})
        entry["overrides"] = overrides
        try:
            with tempfile.TemporaryDirectory() as tmp:
                result = run_rank(compose(overrides), Path(tmp))
                steps = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc(limit=8)
            self.write()
            return
        m = result["metrics"]
        decode_steps = [s["step_s"] for s in steps if s["num_prefill_tokens"] == 0]
        entry.update(
            ttft_s=m["ttft"]["mean_s"],
            tpot_s=m["tpot"]["mean_s"],
            decode_step_p50_s=statistics.median(decode_steps) if decode_steps else None,
            prefill_s=sum(s["step_s"] for s in steps if s["num_prefill_tokens"] > 0),
            num_steps=m["num_steps"],
            cudagraph=m.get("cudagraph"),
            outputs=result["outputs"],
            prompt_lens=prompts,
        )
        if "verify" in result:
            v = result["verify"]
            entry["verify"] = {k: v.get(k) for k in ("passed", "tokens_match", "kv_match", "max_abs_logit_diff")}
        self.write()

    def roofline(self, e: dict) -> None:
        hw = self.report["sections"].get("hardware", {})
        runs = self.report["sections"].get("runs", {})
        hbm, flops = hw.get("hbm_tbps"), hw.get("gemm_bf16_tflops")
        if not hbm or not flops:
            raise Skip("needs the hardware section's figures")
        d = LLAMA3_8B
        kv_dim = d["num_kv_heads"] * d["head_dim"]
        layer = d["hidden_size"] * (2 * d["num_heads"] * d["head_dim"] + 2 * kv_dim) + 3 * d["hidden_size"] * d["intermediate_size"]
        for key, r in runs.items():
            if not key.startswith("llama3_8b_dims/") or "decode_step_p50_s" not in r or self.dry:
                continue
            layers, prompt = 2, r["prompt_lens"][0]
            weights = 2 * (layers * layer + d["vocab_size"] * d["hidden_size"])  # bf16 bytes read
            kv = 2 * layers * 2 * kv_dim * prompt  # K and V of the whole context, per step
            step_floor = (weights + kv) / (hbm * 1e12)
            prefill_flops = 2 * prompt * (layers * layer + d["vocab_size"] * d["hidden_size"] / prompt)
            prefill_flops += layers * 2 * d["num_heads"] * d["head_dim"] * 2 * prompt * prompt / 2
            e[key] = {
                "decode_bytes_per_step": weights + kv,
                "decode_step_hbm_floor_s": step_floor,
                "decode_fraction_of_hbm_limit": step_floor / r["decode_step_p50_s"] if r["decode_step_p50_s"] else None,
                "prefill_flops": prefill_flops,
                "prefill_fraction_of_flop_limit": prefill_flops / (flops * 1e12) / r["prefill_s"] if r.get("prefill_s") else None,
            }


_MODELS: dict = {}


def _share_models() -> None:
    """Build each model once for its eager and graph runs: random weights are drawn in
    float64 on the CPU (seconds per billion parameters), and the runs' own figures
    exclude the build anyway. Models keep no per-run state (caches live in the run)."""
    import pcpflow.rank.engine as engine

    if getattr(engine.build_model, "shared", False):
        return
    build = engine.build_model

    def shared(config, *, dtype, seed, device="cpu"):
        key = (config.model_dump_json(), dtype, seed, str(device))
        if key not in _MODELS:
            _MODELS.clear()  # one model on the GPU at a time
            _MODELS[key] = build(config, dtype=dtype, seed=seed, device=device)
        return _MODELS[key]

    shared.shared = True
    engine.build_model = shared


def _paged_case(spec, ctx_len, chunk, decodes, block, device, dtype):
    """A prefill chunk (the last ``chunk`` positions of a ``ctx_len`` request) and
    ``decodes`` decodes at ``ctx_len``, in shuffled blocks."""
    g = torch.Generator().manual_seed(0)
    reqs = 1 + decodes
    nb = -(-ctx_len // block)
    tables = torch.randperm(reqs * nb, generator=g).view(reqs, nb)
    cache = torch.randn(reqs * nb * block, spec.entry_dim, generator=g).to(device, dtype)
    q = torch.randn(chunk + decodes, spec.num_heads, spec.qk_dim, generator=g).to(device, dtype)
    req = torch.cat([torch.zeros(chunk, dtype=torch.long), torch.arange(1, reqs)])
    ctx = torch.cat([torch.arange(ctx_len - chunk + 1, ctx_len + 1), torch.full((decodes,), ctx_len)])
    return q, cache, spec, tables.to(device), req.to(device), ctx.to(device), block


def _yaml(profile: dict) -> str:
    lines = ["# measured by scripts/gpu_check.py (conf/hardware/*.yaml fields)"]
    for k, v in profile.items():
        if isinstance(v, dict):
            lines.append(f"{k}: {{{', '.join(f'{a}: {b}' for a, b in v.items())}}}")
        else:
            lines.append(f"{k}: {'null' if v is None else v}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: check the script itself")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="report folder (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip sections that would run past this")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    c = Check(out, args.dry_run, args.budget_s)
    c.section("env", c.env)
    c.section("hardware", c.hardware, needs_s=10)
    c.section("profile", c.profile, needs_s=15)
    c.section("attention", c.attention, needs_s=15)
    c.section("runs", c.runs, needs_s=20)
    c.section("predict", c.predict, needs_s=5)
    c.section("roofline", c.roofline)
    c.report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    c.write()
    failed = [k for k, v in c.report["sections"].items() if v.get("status") == "failed"]
    print(json.dumps({k: v.get("status") for k, v in c.report["sections"].items()}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
