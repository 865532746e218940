"""Exact seeded sampling and penalties for a request that continues after a break (vLLM 0.32.0).

When a request's worker dies, kvd's front resubmits it to another engine with the prompt
``original prompt + the k tokens already generated``, ``max_tokens`` reduced by k, and
``kv_transfer_params: {"kvd": {"continues": {"generated": k}}}``: "the last k tokens of this
prompt are tokens this request generated before a break". Greedy decoding then continues exactly;
two other things would not, because vLLM treats the resubmission as a new request:

- **seeded sampling**: the worker seeds a fresh ``torch.Generator`` with ``seed`` for each new
  request (``GPUModelRunner._update_states``), so the resumed request's first token uses the
  uninterrupted run's draw #1 instead of draw #k+1. Every sampling step draws from a seeded
  request's generator exactly once, the prefill step that samples the first token included
  (``TopKTopPSampler``): on the CPU build (``forward_cpu``, Gumbel-argmax) one
  ``torch.randint(0, 2**31, (1,))``; on the fp64-Gumbel path (``use_fp64_gumbel``) and on the
  other platforms (``forward_native`` -> ``random_sample``; FlashInfer and aiter fall back to it
  for per-request generators) one ``exponential_`` over a vocabulary-sized row (float32, or
  float64 with ``use_fp64_gumbel``). A step whose token is discarded (a partial prefill chunk)
  also draws, and the GPU runner rewinds it (``set_offset(get_offset() - 4)``), so kept tokens
  and draws stay one to one (a CPU generator refuses that call: vLLM 0.32.0's CPU build fails a
  seeded request whose prefill is chunked, patch or not). The patch draws those k draws once, when the request's state first
  joins the worker's batch, so the generator stands where the uninterrupted run's stood;
- **frequency and presence penalties** count only output tokens (``apply_penalties`` in
  ``vllm.model_executor.layers.utils``), and the k tokens are prompt tokens now. The patch
  counts them as output tokens again for those two penalties, in the sampler's penalty step only
  (the request's own ``output_token_ids`` stay as vLLM keeps them). The repetition penalty, which
  reads prompt and output tokens together, comes out the same either way.

What it patches (worker process, V1 model runner, ``install()``):

- ``InputBatch.add_request`` (``vllm.v1.worker.gpu_input_batch``; the CPU runner subclasses
  the GPU one): after vLLM's own, a continuing request's generator is fast-forwarded once per
  request state (a preempted request that is added again keeps its state and is not
  fast-forwarded twice), and, where it has a frequency or presence penalty, its k tokens are
  recorded for the batch;
- ``InputBatch._make_sampling_metadata``: the batch rows of those recorded tokens go on the
  sampling metadata (rebuilt whenever the batch's rows change);
- ``Sampler.apply_penalties``: those rows' output tokens are the k tokens followed by the real
  ones.

A request without ``continues`` is not changed: the wrappers only read its parameters. The patch applies to
vLLM ``0.32.0`` (``SUPPORTED_VLLM``) with the V1 model runner and no speculative decoding; on
anything else ``install()`` logs one warning and patches nothing, so continuing requests still
run, as a valid sample rather than the uninterrupted run's tokens. The connector installs it in
its worker process unless ``kv_connector_extra_config.exact_sampling`` is false.

Not made exact here (the front's part, or not possible): ``min_tokens`` (the front lowers it by
k), stop strings that span the break, multi-token bad words that start before it, structured
output grammars and logits processors that keep their own per-request state.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Optional

log = logging.getLogger("kvd.vllm_sampling")

SUPPORTED_VLLM = ("0.32.0",)

# How many times each thing happened in this process (``counters()``; the connector adds them
# to its stats, which vLLM logs as "KV Transfer metrics").
_COUNTERS = {
    "continued_requests": 0,  # requests seen with a valid ``continues``
    "fast_forwarded_requests": 0,  # of them, seeded ones whose generator was fast-forwarded
    "fast_forward_draws": 0,  # the draws those fast-forwards made
    "penalized_requests": 0,  # continuing requests whose k tokens count for their penalties
    "invalid_continues": 0,  # ``continues`` present but malformed (ignored)
}
_lock = threading.Lock()
_installed: Optional[bool] = None  # None: not tried; True: patched; False: refused
_draw: Optional[Callable[[Any, int, Any], None]] = None  # one sampling step's draws


def counters() -> dict[str, int]:
    """What the patch did in this process since it was installed."""
    return dict(_COUNTERS)


def installed() -> bool:
    """Whether this process's vLLM is patched."""
    return bool(_installed)


def continued(sampling_params: Any, prompt_len: int) -> int:
    """k of the request's ``kv_transfer_params.kvd.continues.generated``, 0 without one.

    A malformed value (not an integer from 1 to the prompt's length) is logged and read as 0."""
    extra = getattr(sampling_params, "extra_args", None)
    kv = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    k = kv.get("kvd") if isinstance(kv, dict) else None
    c = k.get("continues") if isinstance(k, dict) else None
    if c is None:
        return 0
    n = c.get("generated") if isinstance(c, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= prompt_len:
        _COUNTERS["invalid_continues"] += 1
        log.warning("kvd: ignoring kv_transfer_params.kvd.continues=%r (prompt of %d tokens)", c, prompt_len)
        return 0
    return n


def install(vllm_config: Any = None) -> bool:
    """Patch this process's vLLM (idempotent): whether it is patched.

    ``vllm_config`` says which sampler path the worker uses (``use_fp64_gumbel``) and whether
    the patch fits (V1 model runner, no speculative decoding); without it the defaults are
    assumed."""
    global _installed, _draw
    with _lock:
        if _installed is not None:
            return _installed
        _installed = False
        refusal = _refusal(vllm_config)
        if refusal:
            log.warning("kvd: exact_sampling not installed (%s): a request resumed after a break "
                        "runs, but seeded sampling and frequency/presence penalties do not continue "
                        "exactly", refusal)
            return False
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.worker.gpu_input_batch import InputBatch

        fp64 = bool(getattr(getattr(vllm_config, "model_config", None), "use_fp64_gumbel", False))
        _draw = _step_draws(fp64)
        InputBatch.add_request = _add_request(InputBatch.add_request)
        InputBatch._make_sampling_metadata = _make_sampling_metadata(InputBatch._make_sampling_metadata)
        Sampler.apply_penalties = staticmethod(_apply_penalties(Sampler.apply_penalties))
        _installed = True
        log.info("kvd: exact_sampling installed (vLLM %s): requests with kvd.continues resume "
                 "their seeded generator and penalties", _vllm_version())
        return True


def _vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return ""
    return str(getattr(vllm, "__version__", ""))


def _refusal(vllm_config: Any) -> str:
    """Why the patch does not fit this vLLM ("" where it does)."""
    version = _vllm_version()
    if version not in SUPPORTED_VLLM:
        return f"written for vLLM {', '.join(SUPPORTED_VLLM)}, this is {version or 'no vLLM'}"
    if vllm_config is None:
        return ""
    try:
        if vllm_config.use_v2_model_runner:
            return "the V2 model runner samples otherwise"
    except Exception as e:  # noqa: BLE001 - a config that cannot say is not patched
        return f"cannot tell the model runner ({e})"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding draws otherwise (rejection sampler)"
    return ""


def _step_draws(fp64: bool) -> Callable[[Any, int, Any], None]:
    """What one sampling step draws from a request's generator, as ``draw(gen, vocab, device)``,
    the way ``TopKTopPSampler`` chooses its path."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    fused = (current_platform.is_cpu() and not fp64
             and current_platform.get_cpu_architecture() not in (CpuArchEnum.RISCV, CpuArchEnum.POWERPC))
    if fused:  # forward_cpu: one seed for fused_gumbel_argmax
        def draw(gen: Any, vocab: int, device: Any) -> None:
            torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)
        return draw
    dtype = torch.float64 if fp64 else torch.float32

    def noise(gen: Any, vocab: int, device: Any) -> None:  # random_sample: q[i].exponential_
        torch.empty(vocab, dtype=dtype, device=gen.device).exponential_(generator=gen)
    return noise


def _add_request(orig: Callable[..., int]) -> Callable[..., int]:
    @functools.wraps(orig)
    def add_request(self: Any, request: Any) -> int:
        index = orig(self, request)
        sp = getattr(request, "sampling_params", None)
        prompt = getattr(request, "prompt_token_ids", None)
        if sp is None or prompt is None:
            return index
        # The request's state lives until it finishes; a preempted or unscheduled request is
        # added again with the same state (and generator): read k and fast-forward only once.
        k: Optional[int] = getattr(request, "kvd_continues", None)
        first = k is None
        if k is None:
            k = request.kvd_continues = continued(sp, len(prompt))
        if k == 0:
            return index
        if first:
            _COUNTERS["continued_requests"] += 1
        if first and request.generator is not None and _draw is not None:
            for _ in range(k):
                _draw(request.generator, self.vocab_size, self.device)
            _COUNTERS["fast_forwarded_requests"] += 1
            _COUNTERS["fast_forward_draws"] += k
            log.info("kvd: request %s continues after %d generated tokens: its seeded generator "
                     "fast-forwarded by %d draws", request.req_id, k, k)
        if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
            if first:
                _COUNTERS["penalized_requests"] += 1
                log.info("kvd: request %s continues after %d generated tokens: they count for its "
                         "frequency and presence penalties", request.req_id, k)
            committed: Optional[dict[str, list[int]]] = getattr(self, "kvd_committed", None)
            if committed is None:
                committed = self.kvd_committed = {}
            committed[request.req_id] = list(prompt[-k:])
        return index
    return add_request


def _make_sampling_metadata(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def make_sampling_metadata(self: Any) -> Any:
        md = orig(self)
        committed: Optional[dict[str, list[int]]] = getattr(self, "kvd_committed", None)
        if committed:
            rows = {}
            for rid in list(committed):  # requests that left the batch are added again if they return
                i = self.req_id_to_index.get(rid)
                if i is None:
                    del committed[rid]
                else:
                    rows[i] = committed[rid]
            if rows:
                md.kvd_committed = rows
        return md
    return make_sampling_metadata


def _apply_penalties(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def apply_penalties(logits: Any, sampling_metadata: Any, output_token_ids: list[list[int]]) -> Any:
        rows: Optional[dict[int, list[int]]] = getattr(sampling_metadata, "kvd_committed", None)
        if rows and not sampling_metadata.no_penalties:
            output_token_ids = list(output_token_ids)
            for i, toks in rows.items():
                if i < len(output_token_ids):
                    output_token_ids[i] = toks + list(output_token_ids[i])
        return orig(logits, sampling_metadata, output_token_ids)
    return apply_penalties
