"""vLLM `general_plugins` entry point: wraps the DSpark draft model class so its forward asks the sidecar shim first.

Loaded by vLLM in every process (`dspark_sidecar = "dspark_sidecar.client.vllm_plugin:register"` in
pyproject). vLLM is imported lazily: without it, `register()` logs and returns. The engine rank's
sidecar endpoint comes from DSPARK_SOCKET_DIR (rank r -> unix:$DSPARK_SOCKET_DIR/rank{r}.sock, the
layout of `dspark-sidecar serve`); unset, the shim refuses with "no sidecar endpoint configured"
and the stock forward runs every step.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
import weakref
from typing import Any

import torch

from dspark_sidecar import layout
from dspark_sidecar.client.agreement import LocalAgreement, StepAgreement, all_min_ints, node_agreement
from dspark_sidecar.client.binding import FP8_DTYPES
from dspark_sidecar.client.config import EngineConfig, EngineConfigError, config_refusal, rank_endpoint
from dspark_sidecar.client.forward_context import ForwardContextSource
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.client.vllm_refusals import (draft_attention_refusal, draft_layout_refusal, kv_groups_refusal,
                                                 kv_memory_refusal, sleep_mode_refusal)

log = logging.getLogger("dspark_sidecar.client")

# Architectures of the DSpark draft model as vLLM registers them; DSPARK_DRAFTER_ARCHS overrides.
DEFAULT_ARCHS = ("DSparkMiniMaxDraftModel", "MiniMaxM3DSparkModel")
_MARK = "_dspark_sidecar_wrapped"


def _archs() -> list[str]:
    raw = os.environ.get("DSPARK_DRAFTER_ARCHS", "")
    return [a.strip() for a in raw.split(",") if a.strip()] or list(DEFAULT_ARCHS)


def engine_config_from_vllm(vllm_config: Any, rank: int, environ: Any = os.environ) -> EngineConfig:
    """The shim's EngineConfig from vLLM's VllmConfig (parallel and speculative config) and the environment.
    A DSPARK_* value that cannot be used is an EngineConfigError naming the variable."""
    pc, spec = vllm_config.parallel_config, getattr(vllm_config, "speculative_config", None)
    # vLLM 0.34 builds the draft with a parallel_config of its own (spec_decode/dspark/utils.py
    # _get_dspark_parallel_config): the draft's TP, PP forced to 1. The draft's TP and the target's PP and DP
    # are read from speculative_config where it has them, alike from the draft's config (build_shim) and the
    # speculator's (init_cudagraph_manager, whose parallel_config is the target's).
    draft_pc = getattr(spec, "draft_parallel_config", None) or pc
    target_pc = getattr(spec, "target_parallel_config", None) or pc
    socket_dir = environ.get("DSPARK_SOCKET_DIR")
    if socket_dir is not None and not socket_dir.strip():  # as `serve` refuses it (cli._env): '   ' is no folder
        raise EngineConfigError(f"DSPARK_SOCKET_DIR={socket_dir!r} is set but empty: unset it to run without the "
                                "sidecar, or give the folder `dspark-sidecar serve` uses (--socket-dir)")
    # Stripped as `serve` strips it (cli._FromEnv): one pod spec's " /run/dspark" is one folder on both sides.
    socket_dir = (socket_dir or "").strip()
    tp = int(draft_pc.tensor_parallel_size)
    problem = layout.socket_dir_problem(socket_dir, tp) if socket_dir else None
    if socket_dir and not problem and not os.path.isabs(socket_dir):
        # Relative to the engine's working directory, which is not the sidecar's: every rank dialled another folder
        # than `serve` listens in and fell back at every step, its one word a connect error.
        problem = ("a relative path, which the engine resolves against its own working directory, not the "
                   "sidecar's; give the absolute folder `dspark-sidecar serve` uses (--socket-dir)")
    if problem:  # the shim would dial a target gRPC reads otherwise, and fall back every step unexplained
        raise EngineConfigError(f"DSPARK_SOCKET_DIR={socket_dir!r}: {problem}")
    device = getattr(getattr(vllm_config, "device_config", None), "device", "cpu")
    kw: dict[str, Any] = {}
    raw = environ.get("DSPARK_STEP_DEADLINE_MS")
    if raw is not None and not raw.strip():
        # As DSPARK_SOCKET_DIR above and `serve`'s variables: '' was read as unset (the 2000 ms default, unsaid, the
        # operator's deadline lost to `=$UNSET_VAR`) while '  ' was "expected a number", for one and the same mistake
        raise EngineConfigError(f"DSPARK_STEP_DEADLINE_MS={raw!r} is set but empty: unset it for the default "
                                f"({EngineConfig.step_deadline_s * 1000:g}) or give a number of milliseconds")
    if raw:
        try:
            kw["step_deadline_s"] = float(raw) / 1000
        except ValueError:
            raise EngineConfigError(f"DSPARK_STEP_DEADLINE_MS={raw!r}: expected a number of milliseconds") from None
    try:
        return EngineConfig(
            tp_size=tp, dp_size=max(int(getattr(c, "data_parallel_size", 1)) for c in (pc, target_pc)),
            pp_size=max(int(getattr(c, "pipeline_parallel_size", 1)) for c in (pc, target_pc)),
            speculative_method=str(getattr(spec, "method", "") or "") if spec is not None else "",
            num_speculative_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0,
            endpoint=rank_endpoint(socket_dir, rank) if socket_dir else "", device=str(device), **kw)
    except EngineConfigError as err:
        # 0, -5, nan, inf: EngineConfig names its field (step_deadline_s) and its bounds in seconds, a value and a field
        # the operator never set ('-1' read "got -0.001"): the variable's own range, in ms (EngineConfig's 0.001..3600 s)
        if raw and str(err).startswith("step_deadline_s:"):
            raise EngineConfigError(f"DSPARK_STEP_DEADLINE_MS={raw!r}: expected a number of milliseconds from 1 "
                                    "to 3600000") from None
        raise


def _tp_agreement(group: Any, timeout_s: float) -> StepAgreement:
    """vLLM's TP GroupCoordinator -> a MIN over its CPU group's ranks (shared memory on one node, else gloo).
    Collective over the group: every TP rank builds its shim at its first drafter forward."""
    if hasattr(group, "all_min"):
        return group
    return node_agreement(group.cpu_group, timeout_s)


def kv_cache_provider(model: torch.nn.Module):
    """The drafter's attention layers' KV caches in layer order; [] while they are not allocated yet
    (profiling). vLLM binds `layer.kv_cache` as one tensor (0.34: attention_layer_base.py), older
    releases as a list indexed by virtual engine; both are read, and re-read at every call since
    vLLM replaces the attribute when it allocates."""
    layers = [m for _, m in model.named_modules() if isinstance(getattr(m, "kv_cache", None), (torch.Tensor, list))]
    # An fp8 layer's float8 view, kept while vLLM holds the same uint8 tensor: a fresh view each
    # step would miss the binder's same-objects check (KVBinder.needs_bind) and cost the full
    # identity of every layer on every step. The view holds the cache's storage until vLLM's next
    # allocation is seen here, one call later. Kept only while the uint8 tensor keeps its memory and
    # layout too: the binder sees only the view, so a stale one would hide a cache moved in place.
    views: dict[int, tuple[tuple, torch.Tensor]] = {}

    def caches() -> list[torch.Tensor]:
        out = []
        for i, m in enumerate(layers):
            kv = m.kv_cache
            t = (kv[0] if kv else None) if isinstance(kv, list) else kv
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                return []
            if e4m3_at_scale_one(m, t):
                hit = views.get(i)
                if hit is None or not _same_place(hit[0], t):
                    hit = views[i] = (_place(t), t.view(torch.float8_e4m3fn))
                t = hit[1]
            elif t.dtype in FP8_DTYPES and _kv_scaled(m):
                # Float8 codes of x / scale held in a float8 tensor: read as values, the sidecar would
                # draft from K/V off by the scale. Its codes go on as uint8, which BindKV refuses by name.
                t = t.view(torch.uint8)
            out.append(t)
        return out

    return caches


def _place(t: torch.Tensor) -> tuple:
    """What a view of `t` was made from: the object (weakly) and its memory and layout then."""
    return weakref.ref(t), t.data_ptr(), t.shape, t.stride()


def _same_place(place: tuple, t: torch.Tensor) -> bool:
    """Whether `t` is the object `place` was read from, at the same memory and layout: not changed in
    place since (`.data =`, `set_`, `as_strided_`). The data pointer includes the storage offset."""
    ref, ptr, shape, stride = place
    return ref() is t and t.data_ptr() == ptr and t.shape == shape and t.stride() == stride


def _kv_scaled(layer: Any) -> bool:
    """Whether the layer names a k or v scale other than 1 (vLLM's calibrated or checkpoint KV scales)."""
    return any(getattr(layer, n, None) not in (None, 1.0) for n in ("_k_scale_float", "_v_scale_float"))


def e4m3_at_scale_one(layer: Any, t: torch.Tensor) -> bool:
    """Whether a layer's uint8 cache holds float8_e4m3fn codes of the values themselves. vLLM holds
    kv_cache_dtype fp8 as uint8 codes of x / scale: that is so where they are e4m3fn (the platform's
    fp8, gfx950's and NVIDIA's) at k and v scale 1. Re-read every step, scales included."""
    if t.dtype != torch.uint8 or str(getattr(layer, "kv_cache_dtype", "")) not in ("fp8", "fp8_e4m3"):
        return False
    if getattr(layer, "_k_scale_float", None) != 1.0 or getattr(layer, "_v_scale_float", None) != 1.0:
        return False
    try:
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype() == torch.float8_e4m3fn
    except (ImportError, AttributeError):
        return False



def full_graph_decode(vllm_config: Any) -> bool:
    """Whether vLLM replays the draft's decode steps as full CUDA graphs (compilation_config.cudagraph_mode
    FULL or FULL_DECODE_ONLY, vLLM 0.34's default for its DSpark speculator): a replayed step runs no
    Python, so it never reaches the shim, and only the eager steps can be forwarded."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    decode = getattr(mode, "decode_mode", None)
    return callable(decode) and getattr(decode(), "name", "") == "FULL"


def eager_draft_steps() -> str:
    """Make vLLM's DSpark speculator run its draft steps eagerly, so that each reaches the shim;
    returns what was done, for the log.

    vLLM 0.34 captures a DSpark draft step whole (model forward and Markov sampling) as a full
    CUDA graph when the deployment's decode mode is FULL, its default; a replay runs no Python,
    so the sidecar would never see a decode step. DSparkSpeculator.init_cudagraph_manager picks
    that mode, and NONE there runs the draft step eagerly while the target model keeps its graphs
    (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py: "PIECEWISE cudagraphs are not supported
    for dflash", so the only other mode is NONE). Applied only with a sidecar configured
    (DSPARK_SOCKET_DIR), unless DSPARK_DRAFT_CUDAGRAPHS=keep."""
    if not os.environ.get("DSPARK_SOCKET_DIR", "").strip():  # set but blank: refused (engine_config_from_vllm)
        return "draft CUDA graphs left as vLLM sets them (no sidecar configured)"
    choice = os.environ.get("DSPARK_DRAFT_CUDAGRAPHS", "").strip().lower() or "eager"  # KEEP, Keep: keep
    if choice == "keep":
        return "draft CUDA graphs kept (DSPARK_DRAFT_CUDAGRAPHS=keep): replayed steps never reach the sidecar"
    if choice != "eager":
        log.warning("DSPARK_DRAFT_CUDAGRAPHS=%r: expected eager (the default) or keep; running the draft steps "
                    "eagerly", choice)
    try:
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    except Exception as e:  # noqa: BLE001  (any import-time failure: raised out of register(), vLLM did not start)
        return f"draft CUDA graphs left as vLLM sets them (no DSparkSpeculator to adjust: {type(e).__name__}: {e})"
    if getattr(DSparkSpeculator, _MARK, False):
        return "draft steps already run eagerly"
    # Checked here, where a refusal leaves vLLM as it is: a speculator without the method raised AttributeError out of
    # register() (no vLLM process started), and one taking no cudagraph_mode, or a CUDAGraphMode without NONE, raised
    # from the patch as the engine set up its speculator.
    stock_init, eager = getattr(DSparkSpeculator, "init_cudagraph_manager", None), getattr(CUDAGraphMode, "NONE", None)
    signature = _mode_signature(stock_init)
    if signature is None or eager is None:
        return ("draft CUDA graphs left as vLLM sets them (no DSparkSpeculator.init_cudagraph_manager taking a "
                "cudagraph_mode, or no CUDAGraphMode.NONE, in this vLLM)")

    @functools.wraps(stock_init)  # its signature, for whoever reads it
    def init_cudagraph_manager(self: Any, *args: Any, **kwargs: Any) -> Any:
        # An engine whose shim is bound to stay off would pay the eager steps for nothing: it keeps its graphs.
        # self.model: the draft model, loaded before the attention is set (vLLM 0.34 load_model, then set_attn)
        off = (shim_off_reason(getattr(self, "vllm_config", None), getattr(self, "model", None))
               or kv_groups_refusal(self))
        if off is not None:
            log.warning("dspark-sidecar: draft CUDA graphs kept as vLLM sets them, since the sidecar shim will stay "
                        "off: %s", off)
            return stock_init(self, *args, **kwargs)
        try:
            call = signature.bind(self, *args, **kwargs)
        except TypeError:  # a call the stock method refuses too: its own error, raised by it
            return stock_init(self, *args, **kwargs)
        call.arguments["cudagraph_mode"] = eager  # by position or keyword, the other arguments as given
        return stock_init(*call.args, **call.kwargs)

    DSparkSpeculator.init_cudagraph_manager = init_cudagraph_manager
    setattr(DSparkSpeculator, _MARK, True)
    return "draft steps run eagerly (no full CUDA graph), so that each reaches the sidecar shim"


def _mode_signature(init: Any) -> inspect.Signature | None:
    """The signature of the speculator's stock init_cudagraph_manager where it takes the mode as `cudagraph_mode`
    (by position or keyword: vLLM's speculators all name it so), or None."""
    if not callable(init):
        return None
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):  # no signature to read: the mode's place unknown
        return None
    mode = signature.parameters.get("cudagraph_mode")
    if mode is None or mode.kind not in (mode.POSITIONAL_OR_KEYWORD, mode.KEYWORD_ONLY):
        return None
    return signature


def draft_steps_eager() -> bool:
    """Whether eager_draft_steps has adjusted vLLM's DSpark speculator in this process."""
    try:
        from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator
    except Exception:  # noqa: BLE001  (as eager_draft_steps: asked inside the drafter's first forward)
        return False
    return bool(getattr(DSparkSpeculator, _MARK, False))


def build_shim(model: torch.nn.Module, vllm_config: Any) -> DrafterShim:
    """The shim of this engine rank, from vLLM's distributed state and forward context."""
    from vllm import forward_context as vfc
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    rank = int(getattr(group, "rank_in_group", 0))
    # Read as the module has them: a vLLM without one raised AttributeError here, out of the drafter's first forward.
    # Without them no step has a context (and shim_off_reason keeps the shim off, by name).
    available, get = getattr(vfc, "is_forward_context_available", None), getattr(vfc, "get_forward_context", None)
    if callable(available) and callable(get):
        source = ForwardContextSource(available, get)
    else:
        source = ForwardContextSource(lambda: False, lambda: None)
    # This runs inside vLLM's first drafter forward: a bad DSPARK_* value raised from here failed the
    # engine's step. It is logged instead, and the shim stays off (the stock layers run every step),
    # on every rank alike since every rank reads the same environment.
    try:
        config = engine_config_from_vllm(vllm_config, rank)
    except EngineConfigError:  # said below (shim_off_reason): the shim is built with no DSPARK_* to stay off
        config = engine_config_from_vllm(vllm_config, rank, environ={})
    off = shim_off_reason(vllm_config, model)  # the verdict eager_draft_steps also reads, to keep the draft graphs
    if off is not None or config_refusal(config) is not None:
        # Off for good, known from the config and environment alone (so on every rank alike): it never agrees on
        # a step. Every vLLM serving a DSpark draft without a sidecar (the plug-in is loaded in every process) ran
        # the page's collectives over the TP group here and kept its shared page mapped, for nothing, and a
        # failure there raised out of the drafter's first forward.
        agreement: StepAgreement = LocalAgreement()
    else:  # after the config: how long a rank waits for its peers follows the deadlines (every rank builds one)
        agreement = _tp_agreement(group, config.agreement_timeout_s)

    class _Par:  # what DrafterShim reads: rank, and the agreement itself
        def __init__(self) -> None:
            self.rank, self.world_size = rank, agreement.world_size

        def all_min(self, values: torch.Tensor) -> torch.Tensor:
            return agreement.all_min(values)

        def all_min_ints(self, values: list[int]) -> list[int]:  # the shared page's own, without tensors
            return all_min_ints(agreement, values)

    shim = DrafterShim(config, model, kv_cache_provider(model), _Par(), forward_context=source)
    if off is not None:
        log.error("dspark-sidecar: %s; the sidecar stays off and every draft step runs the stock layers", off)
        shim.enabled, shim.refusal = False, off
    # Only a shim that may forward loses the replayed steps: one off for good (no sidecar configured, a refusal
    # logged above, its graphs kept on purpose) would be told to unset a DSPARK_DRAFT_CUDAGRAPHS never set.
    if shim.enabled and full_graph_decode(vllm_config) and not draft_steps_eager():
        log.warning("dspark-sidecar: vLLM replays the draft's decode steps as full CUDA graphs "
                    "(compilation_config.cudagraph_mode), which never reach the sidecar shim: only eager steps are "
                    "forwarded. Unset DSPARK_DRAFT_CUDAGRAPHS=keep (the plug-in then runs the draft steps eagerly), "
                    "or run with cudagraph_mode PIECEWISE or enforce_eager")
    return shim


def shim_off_reason(vllm_config: Any, model: Any = None) -> str | None:
    """Why every rank's shim will stay off, known from vLLM's config, the environment and the draft model vLLM
    built (`model`, where given: its layers' attention) alone (a DSPARK_* value it cannot use, a deployment the
    sidecar cannot serve, or sleep mode), or None; None too without a config to read (nothing known yet) and
    without a sidecar configured (off for that plain reason, unsaid)."""
    if getattr(vllm_config, "parallel_config", None) is None:
        return None
    try:
        config = engine_config_from_vllm(vllm_config, 0)  # what is refused does not depend on the rank
    except EngineConfigError as err:
        return str(err)
    # With a sidecar configured, a deployment it cannot serve (TP other than 4, DP or PP > 1, another draft)
    # keeps the shim off for good: the eager draft steps bought nothing, and the shim's own line is INFO,
    # below vLLM's default level. Without one, "no sidecar endpoint configured" is the plain, unlogged case,
    # sleep mode too: it was logged at ERROR on every rank of every vLLM serving a DSpark draft in sleep mode.
    if not config.endpoint:
        return None
    return (config_refusal(config) or draft_layout_refusal(vllm_config) or kv_memory_refusal(vllm_config)
            or draft_attention_refusal(model, vllm_config) or sleep_mode_refusal(vllm_config)
            or _forward_context_refusal())


def _forward_context_refusal() -> str | None:
    """Why the shim could not read vLLM's forward context (the functions build_shim reads it through are missing:
    another vLLM), or None; None too where vLLM's module cannot be imported at all (nothing known)."""
    try:
        from vllm import forward_context as vfc
    except ImportError:
        return None
    if all(callable(getattr(vfc, f, None)) for f in ("is_forward_context_available", "get_forward_context")):
        return None
    return ("vLLM's forward_context module has no is_forward_context_available or get_forward_context, through which "
            "the shim reads each step's attention metadata")


def _embeds_slot(forward: Any) -> int | None:
    """Where the stock `forward(self, input_ids, positions, ...)` takes inputs_embeds among the inputs after
    positions, when it may be passed by position (the DSpark drafters': `forward(input_ids, positions,
    inputs_embeds)`), or None."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C-level forward: keyword only, as before
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names.index("inputs_embeds") - 3 if "inputs_embeds" in names[3:] else None


def _forward_problem(forward: Any) -> str | None:
    """Why the wrapper's forward(self, input_ids, positions, *args, **kwargs), which hands both on by position, cannot
    stand in for the stock one, or None. vLLM calls the draft by keyword: the stock must take input_ids and positions
    first, by those names, or by position only. Else every call raised TypeError from the wrapper."""
    try:
        params = list(inspect.signature(forward).parameters.values())[:3]
    except (TypeError, ValueError):  # a builtin or C-level forward: not judged, as _embeds_slot
        return None
    for p, name in zip(params, (None, "input_ids", "positions")):  # self: any name
        if p.kind is p.VAR_POSITIONAL:  # forward(self, *args, ...), a decorator's (*args, **kwargs): takes them on
            return None
        if not (p.kind is p.POSITIONAL_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name in (None, p.name))):
            break
    else:
        if len(params) == 3:
            return None
    return (f"its forward{inspect.signature(forward)} does not take input_ids and positions first, by position or "
            "by those names, as the plug-in's wrapper hands them on")


def make_sidecar_class(stock: type) -> type:
    """A subclass of vLLM's draft model whose forward asks the shim first and runs the stock forward on None; the
    stock class itself where its forward cannot be wrapped (said in the log: the stock forward runs every step)."""
    if getattr(stock, _MARK, False):
        return stock
    problem = _forward_problem(stock.forward)
    if problem is not None:
        log.warning("dspark-sidecar vLLM plug-in: draft model class %s not wrapped: %s; its steps run the stock "
                    "forward", stock.__name__, problem)
        return stock
    embeds_slot = _embeds_slot(stock.forward)

    class SidecarDrafter(stock):  # type: ignore[misc, valid-type]
        # The stock signature, which vLLM reads to build the class (model_loader/utils.py initialize_model): one
        # naming neither vllm_config nor prefix was taken for an old-style class and built with no arguments.
        @functools.wraps(stock.__init__)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            vllm_config = kwargs.get("vllm_config")
            if vllm_config is None:
                from vllm.config import get_current_vllm_config

                vllm_config = get_current_vllm_config()
            self._dspark_vllm_config = vllm_config
            self._dspark_shim: DrafterShim | None = None

        def dspark_shim(self) -> DrafterShim:
            # Built on first use: vLLM's TP group exists by then, and the KV cache is bound later.
            if self._dspark_shim is None:
                self._dspark_shim = build_shim(self, self._dspark_vllm_config)
            return self._dspark_shim

        def forward(self, input_ids: Any, positions: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # By keyword (vLLM's DSpark speculator) or by position, as the stock forward takes it: one dropped
            # here had the shim embed input_ids instead, and the sidecar drafted from other inputs than the stock.
            embeds = kwargs.get("inputs_embeds")
            if embeds is None and embeds_slot is not None and len(args) > embeds_slot:
                embeds = args[embeds_slot]
            out = self.dspark_shim().maybe_forward(input_ids, positions, embeds)
            if out is not None:
                return out
            return super().forward(input_ids, positions, *args, **kwargs)

    SidecarDrafter.__name__ = SidecarDrafter.__qualname__ = f"Sidecar{stock.__name__}"
    setattr(SidecarDrafter, _MARK, True)
    return SidecarDrafter


# A stock class vLLM registered lazily ("<module>:<Class>", imported only where a process loads that model) is
# wrapped lazily too: the registry gets "<this module>:<_LAZY><tag>__<module>.<Class>", which this module's
# __getattr__ resolves on first use. Loading it in register() imported a model module (and whatever it imports)
# into every vLLM process, the API server too, which vLLM's lazy entries exist to avoid (a module that touches
# CUDA there breaks the workers vLLM forks). <tag> is vLLM's version: vLLM caches a lazy class's interface flags
# under its module's file hash, here this file's, so without it a vLLM upgrade would reuse the old stock's flags.
_LAZY = "Sidecar__"


def _lazy_name(module_name: str, class_name: str, vllm_version: str) -> str:
    # No "__" inside, nor a "_" at its end ("0.34.0+"): the parse splits on the first "__" after the prefix
    tag = re.sub(r"[^0-9A-Za-z]+", "_", vllm_version).strip("_") or "0"
    return f"{_LAZY}{tag}__{module_name}.{class_name}"


def __getattr__(name: str) -> type:
    """The wrapped class behind a lazy registry entry `_lazy_name(...)` (PEP 562), made once."""
    _tag, sep, target = name[len(_LAZY):].partition("__")
    if not name.startswith(_LAZY) or not sep or "." not in target:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, class_name = target.rpartition(".")
    wrapped = make_sidecar_class(getattr(importlib.import_module(module_name), class_name))
    globals()[name] = wrapped  # vLLM loads an entry more than once (inspection, then the model): one class
    return wrapped


def _lazy_target(entry: Any) -> tuple[str, str] | None:
    """(module, class) of a lazily registered entry (vLLM's _LazyRegisteredModel), or None for a loaded one."""
    module_name, class_name = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
    if isinstance(module_name, str) and isinstance(class_name, str) and module_name and class_name:
        return module_name, class_name
    return None


def _stock_class(registry: Any, arch: str) -> type | None:
    """The class vLLM has registered for `arch` (loading a lazily registered one), or None."""
    entry = getattr(registry, "models", {}).get(arch)
    if entry is None:
        return None
    if isinstance(entry, type):
        return entry
    if getattr(entry, "model_cls", None) is not None:
        return entry.model_cls
    load = getattr(entry, "load_model_cls", None)
    return load() if load is not None else None


def register() -> list[str]:
    """vllm.general_plugins hook: wrap every registered DSpark draft architecture; returns those wrapped."""
    try:
        import vllm
        from vllm import ModelRegistry
    except ImportError:
        log.info("dspark-sidecar vLLM plug-in: vLLM is not installed, nothing registered")
        return []
    wrapped = []
    for arch in _archs():
        lazy = _lazy_target(getattr(ModelRegistry, "models", {}).get(arch))
        if lazy is not None:
            if lazy[0] != __name__:  # else wrapped already (vLLM calls the plug-in again in each process)
                version = str(getattr(vllm, "__version__", ""))
                ModelRegistry.register_model(arch, f"{__name__}:{_lazy_name(*lazy, version)}")
                wrapped.append(arch)
            continue
        # vLLM calls every general plug-in in every process, whatever model it serves, and does not catch
        # what one raises: a draft model class that fails to import here (a lazily registered module whose
        # dependencies this host lacks) stopped every vLLM process on it from starting. vLLM itself would
        # fail only when that model is used; so the arch is left unwrapped, and the reason logged.
        try:
            stock = _stock_class(ModelRegistry, arch)
        except Exception as e:  # noqa: BLE001  (any import-time failure of vLLM's model module)
            log.warning("dspark-sidecar vLLM plug-in: draft model %s not wrapped: loading its class raised %s: %s",
                        arch, type(e).__name__, e)
            continue
        if stock is None or getattr(stock, _MARK, False):
            continue
        cls = make_sidecar_class(stock)
        if cls is stock:  # not wrapped (logged): left as vLLM registered it
            continue
        ModelRegistry.register_model(arch, cls)
        wrapped.append(arch)
    log.info("dspark-sidecar vLLM plug-in: draft model(s) %s forward through the sidecar shim; %s",
             ", ".join(wrapped) or "none found", eager_draft_steps() if wrapped else "nothing else changed")
    return wrapped
