"""torch.distributed.pipelining's schedules on CPU/gloo, measured ahead of shardscope's pipeline strategies (issue 46).

A tiny decoder (8 blocks, d 32, vocab 128, seq 16, global batch 8, fp32) split into stages by hand (embeddings on the
first, head and loss on the last), trained 3 AdamW steps by one schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) against a one-process full-batch reference: loss and gradient parity,
the bytes each rank hands to isend/irecv against theory (n_mb activations forward and n_mb gradients back per
cross-rank stage boundary), the schedule's profiler spans and action grid. Findings: benchmarks/RESULTS.md.

    timeout 300 python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/pipeline_schedules.py \
        --schedule NAME [--n-mb M] [--loss-mode mean|sum|mean_noscale] [--tied] [--dynamic] [--out DIR]

Each rank writes DIR/<tag>/rank<r>.json (default DIR: ./pipeline_results).
"""
import argparse
import copy
import datetime
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(1)

# ---------------------------------------------------------------- p2p counter
# dist.send/recv call c10d.isend/irecv internally and batch_isend_irecv calls
# p2p_op.op (which is whatever isend/irecv the P2POp was built with), so
# wrapping isend/irecv in BOTH namespaces counts every p2p byte exactly once.
PHASE = {"name": "init", "counting": False}
COUNTS = {}  # phase -> {"send_bytes","recv_bytes","send_ops","recv_ops","by_kind":{}}


def _bucket(kind, tensor):
    if not PHASE["counting"]:
        return
    ph = COUNTS.setdefault(PHASE["name"], {"send_bytes": 0, "recv_bytes": 0,
                                           "send_ops": 0, "recv_ops": 0, "by_kind": {}})
    nb = tensor.numel() * tensor.element_size()
    ph[f"{kind}_bytes"] += nb
    ph[f"{kind}_ops"] += 1
    key = f"{kind}:{str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)}"
    ent = ph["by_kind"].setdefault(key, [0, 0])
    ent[0] += 1
    ent[1] += nb


def _wrap(orig, kind):
    def wrapper(tensor, *args, **kwargs):
        _bucket(kind, tensor)
        return orig(tensor, *args, **kwargs)
    wrapper.__name__ = orig.__name__
    wrapper.__wrapped__ = orig
    return wrapper


_isend = _wrap(c10d.isend, "send")
_irecv = _wrap(c10d.irecv, "recv")
for mod in (c10d, dist):
    mod.isend = _isend
    mod.irecv = _irecv

from torch.distributed import pipelining as ppl  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402
from torch.distributed.pipelining import schedules as S  # noqa: E402

# ---------------------------------------------------------------- model
V, D, T, H, NLAYER, B = 128, 32, 16, 4, 8, 8


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Full(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.blocks = nn.ModuleDict({str(i): Block(D, H) for i in range(NLAYER)})
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for i in range(NLAYER):
            x = self.blocks[str(i)](x)
        return self.head(self.ln_f(x))


class StageMod(nn.Module):
    """A slice of Full with the same parameter names (so grads map 1:1)."""

    def __init__(self, full, layers, first, last, tied=False, shared_tok=None):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok = copy.deepcopy(full.tok) if shared_tok is None else shared_tok
            self.pos = nn.Parameter(full.pos.detach().clone())
        self.blocks = nn.ModuleDict({str(i): copy.deepcopy(full.blocks[str(i)]) for i in layers})
        self.layers = list(layers)
        if last:
            self.ln_f = copy.deepcopy(full.ln_f)
            self.head = nn.Linear(D, V, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(full.head.weight)
            if tied and shared_tok is not None:
                self.head.weight = shared_tok.weight  # same Parameter object

    def forward(self, x):
        if self.first:
            x = self.tok(x) + self.pos[: x.shape[1]]
        for i in self.layers:
            x = self.blocks[str(i)](x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


# ---------------------------------------------------------------- helpers
SINGLE = {"GPipe", "1F1B"}
LOOP = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"}
VSTYLE = {"ZBVZeroBubble", "DualPipeV"}


def stage_layout(name, ws, v):
    if name in SINGLE:
        n_stages = ws
        mapping = {s: s for s in range(n_stages)}
    elif name in LOOP:
        n_stages = ws * v
        mapping = {s: s % ws for s in range(n_stages)}
    elif name in VSTYLE:
        n_stages = ws * 2
        mapping = {s: (s if s < ws else 2 * ws - 1 - s) for s in range(n_stages)}
    else:
        raise ValueError(name)
    return n_stages, mapping


def simulate_bubble(order, stage_to_rank, n_stages, cost):
    """Event simulation of the compute-only action grid (Nones dropped).
    Dependencies: F(s,m)<-F(s-1,m); B/I(s,m)<-F(s,m), B/I(s+1,m); W(s,m)<-I(s,m)."""
    acts = {}
    for r, lst in order.items():
        flat = []
        for a in lst:
            if a is None:
                continue
            if a.sub_actions:
                flat.extend(a.sub_actions)
            elif a.is_compute_op:
                flat.append(a)
        acts[r] = flat
    done = {}
    t_rank = {r: 0.0 for r in acts}
    ptr = {r: 0 for r in acts}
    busy = {r: 0.0 for r in acts}

    def deps(a):
        c, s, m = a.computation_type.value, a.stage_index, a.microbatch_index
        if c == "F":
            return [("F", s - 1, m)] if s > 0 else []
        if c in ("B", "I"):
            d = [("F", s, m)]
            if s < n_stages - 1:
                d.append(("BI", s + 1, m))
            return d
        if c == "W":
            return [("BI", s, m)]
        return []

    def key(a):
        c = a.computation_type.value
        return ("BI" if c in ("B", "I") else c, a.stage_index, a.microbatch_index)

    remaining = sum(len(v) for v in acts.values())
    while remaining:
        progressed = False
        for r in acts:
            while ptr[r] < len(acts[r]):
                a = acts[r][ptr[r]]
                ds = deps(a)
                if not all(d in done for d in ds):
                    break
                start = max([t_rank[r]] + [done[d] for d in ds])
                dur = cost[a.computation_type.value]
                t_rank[r] = start + dur
                busy[r] += dur
                done[key(a)] = start + dur
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return {"error": "deadlock in simulation"}
    makespan = max(t_rank.values())
    total_busy = sum(busy.values())
    return {"makespan": makespan, "busy_per_rank": busy,
            "bubble_fraction": 1 - total_busy / (len(acts) * makespan)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", required=True)
    ap.add_argument("--n-mb", type=int, default=4)
    ap.add_argument("--v", type=int, default=2, help="stages per rank for looped schedules")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--loss-mode", default="mean", choices=["mean", "sum", "mean_noscale"])
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--dynamic", action="store_true", help="do not pass input_args/output_args")
    ap.add_argument("--static-nograd", action="store_true", help="reproduce: example tensors without requires_grad")
    ap.add_argument("--out", default="pipeline_results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    tag = args.tag or f"{args.schedule}_ws{ws}_{args.loss_mode}" + ("_tied" if args.tied else "") + ("_dyn" if args.dynamic else "") + ("_nograd" if args.static_nograd else "") + (f"_mb{args.n_mb}" if args.n_mb != 4 else "")
    outdir = os.path.join(args.out, tag)
    os.makedirs(outdir, exist_ok=True)
    res = {"schedule": args.schedule, "ws": ws, "rank": rank, "torch": torch.__version__,
           "n_mb": args.n_mb, "loss_mode": args.loss_mode, "tied": args.tied, "dynamic": args.dynamic}
    try:
        run(args, rank, ws, res)
        res["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc()
        res["status"] = "error"
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        res["traceback_tail"] = tb.splitlines()[-60:]
        print(f"[rank{rank}] ERROR {res['error']}", file=sys.stderr, flush=True)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    if res["status"] == "ok":
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(1)


def run(args, rank, ws, res):
    name = args.schedule
    cls = getattr(S, "Schedule" + name, None)
    if cls is None:
        raise RuntimeError(f"Schedule{name} not present in this torch")
    n_stages, mapping = stage_layout(name, ws, args.v)
    n_mb = args.n_mb
    if NLAYER % n_stages:
        raise RuntimeError(f"{NLAYER} layers not divisible into {n_stages} stages")
    per = NLAYER // n_stages
    my_stages = sorted(s for s, r in mapping.items() if r == rank)
    res["n_stages"] = n_stages
    res["my_stages"] = my_stages

    torch.manual_seed(0)
    full = Full(tied=args.tied)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, T), generator=g)
    tgt = torch.randint(0, V, (B, T), generator=g)
    mb = -(-B // n_mb)  # torch.tensor_split-style chunking: first chunks get ceil(B/n_mb)

    # ---- reference: single process, whole batch, mean CE, AdamW
    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses, ref_grads0 = [], None
    for step in range(args.steps):
        ref_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ref(idx).reshape(-1, V), tgt.reshape(-1))
        loss.backward()
        if step == 0:
            ref_grads0 = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
            if args.tied:
                ref_grads0["head.weight"] = ref.tok.weight.grad.detach().clone()
        ref_opt.step()
        ref_losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    if args.tied:
        ref_params["head.weight"] = ref.tok.weight

    # ---- pipeline stages
    shared_tok = None
    if args.tied and 0 in my_stages and (n_stages - 1) in my_stages:
        shared_tok = copy.deepcopy(full.tok)
    mods, stages = [], []
    for s in my_stages:
        first, last = s == 0, s == n_stages - 1
        m = StageMod(full, range(s * per, (s + 1) * per), first, last, tied=args.tied, shared_tok=shared_tok)
        mods.append(m)
        kw = {}
        if not args.dynamic:
            rg = not args.static_nograd  # float example tensors must say requires_grad=True
            inp = torch.zeros(mb, T, dtype=torch.long) if first else torch.zeros(mb, T, D, requires_grad=rg)
            out = torch.zeros(mb, T, V, requires_grad=rg) if last else torch.zeros(mb, T, D, requires_grad=rg)
            kw = dict(input_args=(inp,), output_args=(out,))
        stages.append(PipelineStage(m, s, n_stages, torch.device("cpu"), **kw))
    res["shared_tied_param"] = shared_tok is not None

    # compute-only timers: wrap the stage's compute entry points on the instance
    # (the schedule's profiler spans also contain the recv waits; 1F1B has none)
    COMPUTE = {"s": 0.0}
    def _timed(fn):
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                COMPUTE["s"] += time.perf_counter() - t0
        return w
    for st in stages:
        for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, meth, _timed(getattr(st, meth)))

    if args.loss_mode == "mean":
        loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, V), y.reshape(-1))  # noqa: E731
        scale = True
    elif args.loss_mode == "mean_noscale":
        loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, V), y.reshape(-1))  # noqa: E731
        scale = False
    else:  # sum over microbatch / global token count; no schedule scaling
        loss_fn = lambda out, y: F.cross_entropy(out.reshape(-1, V), y.reshape(-1), reduction="sum") / (B * T)  # noqa: E731
        scale = False

    if name in SINGLE:
        if len(stages) != 1:
            raise RuntimeError("single schedule needs one stage")
        sched = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=scale)
    else:
        sched = cls(stages, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=scale)

    # ---- action grid / theoretical bubble
    po = getattr(sched, "pipeline_order", None)
    res["has_pipeline_order"] = po is not None
    res["has_pipeline_order_with_comms"] = hasattr(sched, "pipeline_order_with_comms")
    if rank == 0 and po:
        res["pipeline_order_str"] = S._format_pipeline_order(po)
        s2r = getattr(sched, "stage_index_to_group_rank", None) or {s: s for s in range(n_stages)}
        res["stage_index_to_group_rank"] = s2r
        for label, cost in (("F1_B2_I1_W1", {"F": 1, "B": 2, "I": 1, "W": 1}),
                            ("unit", {"F": 1, "B": 1, "I": 1, "W": 1})):
            res[f"sim_bubble_{label}"] = simulate_bubble(po, lambda s: s2r[s], n_stages, cost)
        n_none = {r: sum(1 for a in lst if a is None) for r, lst in po.items()}
        res["grid_len_and_nones"] = {r: [len(lst), n_none[r]] for r, lst in po.items()}
        if hasattr(sched, "pipeline_order_with_comms"):
            res["pipeline_order_with_comms_rank0"] = [str(a) for a in sched.pipeline_order_with_comms[0]]

    # tied across ranks: 2-rank subgroup between the holders of stage 0 and stage n-1
    tie_group = None
    if args.tied and mapping[0] != mapping[n_stages - 1]:
        tie_group = dist.new_group([mapping[0], mapping[n_stages - 1]])

    params = [p for m in mods for p in m.parameters()]
    uniq = list({id(p): p for p in params}.values())
    opt = torch.optim.AdamW(uniq, lr=1e-2)
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)

    pp_losses, step_times, compute_times = [], [], []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        PHASE["name"] = f"step{step}"
        PHASE["counting"] = True
        losses = []
        COMPUTE["s"] = 0.0
        t0 = time.perf_counter()
        if has_first:
            sched.step(idx, target=tgt if has_last else None, losses=losses if has_last else None)
        elif has_last:
            sched.step(target=tgt, losses=losses)
        else:
            sched.step()
        step_times.append(time.perf_counter() - t0)
        compute_times.append(COMPUTE["s"])
        PHASE["counting"] = False
        if tie_group is not None and (has_first or has_last):
            w = mods[0].tok.weight if has_first else mods[-1].head.weight
            dist.all_reduce(w.grad, group=tie_group)
        if has_last:
            tot = torch.stack([l.detach() for l in losses])
            pp_losses.append((tot.mean() if args.loss_mode != "sum" else tot.sum()).item())
            if step == 0:
                res["n_losses_returned"] = len(losses)
                res["mb_losses_step0"] = [l.item() for l in losses]
        if step == 0:
            gd = 0.0
            worst = None
            for m in mods:
                for n, p in m.named_parameters():
                    if p.grad is None:
                        continue
                    d = (p.grad - ref_grads0[n]).abs().max().item()
                    rel = d / (ref_grads0[n].abs().max().item() + 1e-30)
                    if d > gd:
                        gd, worst = d, (n, rel)
            res["grad_maxabs_step0"] = gd
            res["grad_worst"] = worst
            missing = [n for m in mods for n, p in m.named_parameters() if p.grad is None]
            res["params_without_grad"] = missing
            if args.loss_mode == "mean_noscale":
                # ratio PP grad / ref grad
                n0, p0 = next((n, p) for m in mods for n, p in m.named_parameters() if p.grad is not None)
                res["grad_ratio_vs_ref"] = (p0.grad.norm() / ref_grads0[n0].norm()).item()
        opt.step()
    res["step_times_s"] = step_times
    res["compute_times_s"] = compute_times
    res["measured_idle_fraction"] = [1 - c / t for c, t in zip(compute_times, step_times)]
    if has_last:
        res["pp_losses"] = pp_losses
        res["ref_losses"] = ref_losses
        res["loss_maxabs"] = max(abs(a - b) for a, b in zip(pp_losses, ref_losses))
        res["loss_step0_absdiff"] = abs(pp_losses[0] - ref_losses[0])
    pd, pworst = 0.0, None
    for m in mods:
        for n, p in m.named_parameters():
            d = (p.detach() - ref_params[n].detach()).abs().max().item()
            if d > pd:
                pd, pworst = d, n
    res["param_maxabs_after_steps"] = pd
    res["param_worst"] = pworst

    # ---- bytes: theory
    act = mb * T * D * 4
    th_send = th_recv = 0
    for s in my_stages:
        if s > 0 and mapping[s - 1] != rank:
            th_recv += n_mb * act       # fwd activation in
            th_send += n_mb * act       # grad wrt input out
        if s < n_stages - 1 and mapping[s + 1] != rank:
            th_send += n_mb * act       # fwd activation out
            th_recv += n_mb * act       # grad wrt output in
    res["theory_bytes_per_step"] = {"send": th_send, "recv": th_recv, "act_bytes": act}
    res["p2p_counts"] = COUNTS

    # ---- profiler: one more step
    from torch.profiler import ProfilerActivity, profile
    opt.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        if has_first:
            sched.step(idx, target=tgt if has_last else None)
        elif has_last:
            sched.step(target=tgt)
        else:
            sched.step()
        wall = time.perf_counter() - t0
    evs = prof.events()
    pat = re.compile(r"(PP|Forward|Backward|^\d+[FBIW]\d+|send|recv|gloo|p2p|pipeline)", re.I)
    names = sorted({e.name for e in evs if pat.search(e.name)})
    res["profiler_span_names"] = names[:80]
    res["profiler_span_names_total"] = len(names)
    comp = re.compile(r"^(PP:\d+[FBIW]\d+|PP:\(.*\)OVERLAP_F_B|Forward \d+|Backward \d+)$")
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in evs if comp.match(e.name)]
    busy = sum(e - s for _, s, e in spans)
    # children of compute spans that look like waits
    res["profiled_step_wall_us"] = wall * 1e6
    res["profiled_compute_span_sum_us"] = busy
    res["profiled_compute_spans"] = len(spans)
    if spans:
        t_first = min(s for _, s, _ in spans)
        t_last = max(e for _, _, e in spans)
        res["profiled_first_to_last_span_us"] = t_last - t_first
    # top-level ops inside PP spans that are waits / comms
    waits = {}
    for e in evs:
        if re.search(r"(wait|recv|send|gloo)", e.name, re.I):
            waits[e.name] = waits.get(e.name, 0) + (e.time_range.end - e.time_range.start)
    res["profiler_wait_like_us"] = waits


if __name__ == "__main__":
    main()
