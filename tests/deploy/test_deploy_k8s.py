"""Kubernetes manifests: schema-valid (offline, strict) and consistent with the sidecar's contract."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from deploy.deploy_files import (
    CONTRACT_FLAG_ENV,
    HEALTHCHECK_MODULE,
    K8S,
    VARIANTS,
    env_of,
    kustomization_files,
    load_docs,
    load_variant,
    manifest_files,
    mounts_of,
    serve_config_from_env,
    serve_flag_env,
)
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.server import sockdir

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (ships the schemas)")

# resource.k8s.io/v1 (the shared GPU claim) is GA from 1.34; also check the newest shipped.
K8S_VERSIONS = sorted({"1.34.0", kv.latest_version()})
GPU = {"amd": ("gpu.amd.com", "amd.com/gpu"), "nvidia": ("gpu.nvidia.com", "nvidia.com/gpu")}


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    return load_variant(request.param)


def _docs():
    return [(f, i, d) for f in manifest_files() for i, d in enumerate(load_docs(f))]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "path,index,doc", _docs(), ids=[f"{f.relative_to(K8S)}#{i}" for f, i, _ in _docs()]
)
def test_manifest_validates_against_schema(path, index, doc, version):
    # strict: unknown fields are errors, so a misspelt key cannot slip through as ignored.
    kv.validate(doc, version, strict=True)


def test_schema_validation_rejects_a_broken_manifest():
    doc = copy.deepcopy(load_variant("amd").one("Deployment"))
    doc["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"] = ["Always"]
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSIONS[0], strict=True)


def test_kustomizations_cover_every_manifest():
    used = {p for v in VARIANTS for p in kustomization_files(K8S / v)}
    assert all(p.exists() for p in used), sorted(str(p) for p in used if not p.exists())
    assert set(manifest_files()) <= used, "manifests no kustomization applies"
    for v in VARIANTS:
        assert set(kustomization_files(K8S / "base")) <= set(kustomization_files(K8S / v))


def test_cli_has_every_flag_the_deploy_files_rely_on():
    assert CONTRACT_FLAG_ENV <= serve_flag_env(), CONTRACT_FLAG_ENV - serve_flag_env()


def test_configmap_is_a_valid_serve_configuration(variant):
    cfg = variant.config
    assert set(cfg) <= serve_flag_env(), set(cfg) - serve_flag_env()
    serve = serve_config_from_env(cfg)  # the real CLI and ServeConfig validation
    assert serve.tp == 4 and str(serve.socket_dir) == cfg["DSPARK_SOCKET_DIR"]
    assert serve.metrics_port == int(cfg["DSPARK_METRICS_PORT"]) and serve.preset in PRESETS
    # Strict refusal would fail the startup probe on a refused fast path, and with it the pod.
    assert serve.strict_refusal is False


def test_sidecar_is_a_native_sidecar_started_before_the_engine(variant):
    init = [c["name"] for c in variant.pod["initContainers"]]
    assert [c["name"] for c in variant.pod["containers"]] == ["engine"]
    assert variant.container("dspark-sidecar")["restartPolicy"] == "Always"
    assert variant.container("dspark-sidecar")["args"] == ["serve"]
    if variant.name == "nvidia":
        # MPS must answer before the first CUDA context, or that process runs without MPS.
        assert init == ["nvidia-mps", "dspark-sidecar"]
        assert variant.container("nvidia-mps")["restartPolicy"] == "Always"
        assert "startupProbe" in variant.container("nvidia-mps")
    else:
        assert init == ["dspark-sidecar"]
    env_from = variant.container("dspark-sidecar")["envFrom"]
    assert env_from == [{"configMapRef": {"name": variant.one("ConfigMap")["metadata"]["name"]}}]


def test_probes_check_every_rank_where_the_configmap_puts_the_sockets(variant):
    cfg = variant.config
    expected = ["python", "-m", HEALTHCHECK_MODULE, "--all-ranks", "--socket-dir", cfg["DSPARK_SOCKET_DIR"],
                "--tp", cfg["DSPARK_TP"]]
    sidecar = variant.container("dspark-sidecar")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["exec"]["command"] == expected, probe
    # Weight loading gets minutes, not the default 30 s.
    startup = sidecar["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_socket_dir_is_one_shared_pod_local_volume(variant):
    cfg = variant.config
    sidecar, engine = variant.container("dspark-sidecar"), variant.container("engine")
    assert mounts_of(sidecar)["dspark-sockets"] == cfg["DSPARK_SOCKET_DIR"]
    assert mounts_of(engine)["dspark-sockets"] == cfg["DSPARK_SOCKET_DIR"]
    ref = env_of(engine)["DSPARK_SOCKET_DIR"]["valueFrom"]["configMapKeyRef"]
    assert ref == {"name": variant.one("ConfigMap")["metadata"]["name"], "key": "DSPARK_SOCKET_DIR"}
    volumes = {v["name"]: v for v in variant.pod["volumes"]}
    assert "emptyDir" in volumes["dspark-sockets"]
    # kubelet makes the emptyDir root's and world-writable (0777; with medium: Memory, the tmpfs mount's
    # own mode, typically 1777). `serve` accepts such a folder only when it is setgid, which kubelet adds
    # with the pod's fsGroup (server/sockdir.py); the 0660 sockets then belong to the engine's group too.
    sc = variant.pod["securityContext"]
    assert isinstance(sc["fsGroup"], int)
    assert sockdir.problem(Path(cfg["DSPARK_SOCKET_DIR"]), 0, 0o43777, sc["runAsUser"]) is None
    assert sockdir.problem(Path(cfg["DSPARK_SOCKET_DIR"]), 0, 0o41777, sc["runAsUser"]) is not None  # no fsGroup


def test_ipc_settings_for_gpu_handles(variant):
    pod = variant.pod
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    for name in ("dspark-sidecar", "engine"):
        assert mounts_of(variant.container(name))["dshm"] == "/dev/shm"
    assert pod["shareProcessNamespace"] is True
    for host_ns in ("hostIPC", "hostPID", "hostNetwork"):
        assert pod.get(host_ns, False) is False, host_ns


def test_one_gpu_claim_shared_by_every_container(variant):
    device_class, taint = GPU[variant.name]
    template = variant.one("ResourceClaimTemplate")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == device_class
    assert request["exactly"]["count"] == int(variant.config["DSPARK_TP"])
    (claim,) = variant.pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    for c in variant.all_containers():
        assert c["resources"]["claims"] == [{"name": claim["name"]}], c["name"]
    assert taint in {t["key"] for t in variant.pod["tolerations"]}


def test_resources_and_security_context(variant):
    pod = variant.pod
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in variant.all_containers():
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert not sc.get("privileged", False), c["name"]
        # One UID for the whole pod: MPS serves one user; IPC handles cross the containers.
        assert "runAsUser" not in sc, c["name"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
    assert variant.container("dspark-sidecar")["securityContext"]["readOnlyRootFilesystem"] is True


def _vllm_switch(args: list[str], name: str) -> bool | None:
    """An --enable-<name> switch as vLLM 0.34's parser reads it (utils/argparse_utils.py EnableDisableAction: the
    last of --enable-, --disable-, and the hidden --no-enable- / --no-disable- spellings wins), None if absent."""
    spellings = {f"--enable-{name}": True, f"--no-disable-{name}": True,
                 f"--disable-{name}": False, f"--no-enable-{name}": False}
    seen = [spellings[a] for a in args if a in spellings]
    return seen[-1] if seen else None


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# The attention backend vLLM 0.34 gives a non-causal draft that names none: the first of its platform's priorities
# (platforms/rocm.py _get_backend_priorities: ROCM_ATTN first; platforms/cuda.py: FLASH_ATTN first below SM100).
_DEFAULT_DRAFT_BACKEND = {"amd": "ROCM_ATTN", "nvidia": "FLASH_ATTN"}


def test_the_draft_attention_backend_each_engine_gets_is_one_the_sidecar_reads(variant):
    """The backend lays out the draft's KV cache; the plug-in keeps the shim off for one the sidecar cannot read
    (ROCm's default among them). A manifest that left the draft to ROCm's default shipped a fast path that never
    engaged on MI355X, the platform it is for."""
    from dspark_sidecar.client.vllm_refusals import draft_attention_refusal

    spec = json.loads(_flag(variant.container("engine")["args"], "--speculative-config"))
    backend = spec.get("attention_backend") or _DEFAULT_DRAFT_BACKEND[variant.name]
    # The draft's layers as vLLM builds them: the spec's non-causal block over the window, the backend's name.
    attn = SimpleNamespace(causal=False, sliding_window=4096, rotary_emb=SimpleNamespace(rotary_dim=64),
                           attn=SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend)))
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)] * 5))
    hf = SimpleNamespace(sliding_window=4096, rotary_dim=64)
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    assert draft_attention_refusal(model, vllm_config) is None, (backend, draft_attention_refusal(model, vllm_config))


def test_engine_arguments_pass_the_shims_deployment_checks(variant):
    """The engine's TP size and speculative config are what the client shim checks before forwarding (the seed's
    "TP n != 4", "no DSpark draft", "7 speculative tokens required"): any other value, or a draft model other than
    the sidecar's checkpoint, leaves the sidecar serving while every draft step runs the stock layers. So does
    vLLM 0.34's default extensible KV cache (driver-mapped memory no IPC handle shares): the engine turns it off."""

    from dspark_sidecar.client.config import config_refusal
    from dspark_sidecar.client.vllm_plugin import engine_config_from_vllm
    from dspark_sidecar.client.vllm_refusals import kv_memory_refusal

    cfg, engine = variant.config, variant.container("engine")
    args = engine["args"]
    spec = json.loads(_flag(args, "--speculative-config"))
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=int(_flag(args, "--tensor-parallel-size"))),
        speculative_config=SimpleNamespace(**spec),
        # vLLM 0.34 turns the extensible (driver-mapped) KV cache on unless told not to: no IPC could share it
        cache_config=SimpleNamespace(enable_extensible_kv_cache=_vllm_switch(args, "extensible-kv-cache") is not False))
    assert env_of(engine)["DSPARK_SOCKET_DIR"]["valueFrom"]["configMapKeyRef"]["key"] == "DSPARK_SOCKET_DIR"
    shim = engine_config_from_vllm(vllm_config, 0, {"DSPARK_SOCKET_DIR": cfg["DSPARK_SOCKET_DIR"]})
    assert config_refusal(shim) is None, config_refusal(shim)
    assert kv_memory_refusal(vllm_config) is None, kv_memory_refusal(vllm_config)
    assert shim.tp_size == int(cfg["DSPARK_TP"])
    assert (args[0], spec["model"]) == (cfg["DSPARK_TARGET_CHECKPOINT"], cfg["DSPARK_CHECKPOINT"])


def test_amd_pod_joins_the_groups_of_the_gpu_device_nodes():
    """/dev/kfd and /dev/dri/renderD* are group video / render on the node, not world-accessible as NVIDIA's
    nodes are: a pod without those GIDs sees no GPU, and `serve --device cuda` refuses to start (exit 2)."""
    groups = load_variant("amd").pod["securityContext"].get("supplementalGroups", [])
    assert groups and all(isinstance(g, int) and g > 0 for g in groups), groups


def test_engine_keeps_registered_memory_out_of_expandable_segments(variant):
    env = env_of(variant.container("engine"))
    key = "PYTORCH_HIP_ALLOC_CONF" if variant.name == "amd" else "PYTORCH_CUDA_ALLOC_CONF"
    assert "expandable_segments:False" in env[key]["value"]


def test_metrics_ports_one_per_rank_and_admitted_by_the_network_policy(variant):
    cfg = variant.config
    base, tp = int(cfg["DSPARK_METRICS_PORT"]), int(cfg["DSPARK_TP"])
    ports = sorted(p["containerPort"] for p in variant.container("dspark-sidecar")["ports"])
    assert ports == [base + r for r in range(tp)]
    rules = variant.one("NetworkPolicy")["spec"]["ingress"]
    metrics = [p for rule in rules if "from" in rule for p in rule["ports"]]
    assert any(p["port"] == base and p["endPort"] == base + tp - 1 for p in metrics)


def test_metrics_listen_on_the_pod_address_the_network_policy_opens(variant):
    """The ports are declared and the NetworkPolicy admits the `monitoring` namespace to them, but serve binds
    its metrics to --metrics-host, 127.0.0.1 by default: without DSPARK_METRICS_HOST in the ConfigMap nothing
    listens on the pod's address, and every scrape from outside the pod is refused."""
    from dspark_sidecar.server.config import is_loopback

    serve = serve_config_from_env(variant.config)
    assert serve.metrics_port and not is_loopback(serve.metrics_host), serve.metrics_host


def test_the_pods_grace_period_outlasts_the_sidecars_stop(variant):
    """The native sidecar is sent SIGTERM only after the engine has exited, within the pod's one grace period;
    kubelet's SIGKILL at its end cut the ranks' drain and teardown short (the launcher's own limit for a rank
    is --drain-s + DRAIN_GRACE_S after SIGTERM), as TimeoutStopSec is set past it in the systemd unit."""
    from dspark_sidecar.server.launcher import DRAIN_GRACE_S

    serve = serve_config_from_env(variant.config)
    assert serve.drain_s + DRAIN_GRACE_S < variant.pod["terminationGracePeriodSeconds"]


def test_nvidia_mps_pipe_is_shared_by_daemon_and_clients():
    v = load_variant("nvidia")
    pipe = env_of(v.container("nvidia-mps"))["CUDA_MPS_PIPE_DIRECTORY"]["value"]
    volumes = {vol["name"]: vol for vol in v.pod["volumes"]}
    assert "emptyDir" in volumes["mps-pipe"]
    for name in ("nvidia-mps", "dspark-sidecar", "engine"):
        c = v.container(name)
        assert mounts_of(c)["mps-pipe"] == pipe, name
        if name != "nvidia-mps":
            assert env_of(c)["CUDA_MPS_PIPE_DIRECTORY"]["value"] == pipe, name
            assert env_of(c)["CUDA_DEVICE_ORDER"]["value"] == "PCI_BUS_ID", name
    assert v.container("nvidia-mps")["command"] == ["nvidia-cuda-mps-control", "-f"]


def _vendor_neutral(variant) -> dict:
    """The Deployment with every vendor-specific piece removed, for comparing the variants."""
    dep = copy.deepcopy(variant.one("Deployment"))
    pod = dep["spec"]["template"]["spec"]
    pod["initContainers"] = [c for c in pod["initContainers"] if c["name"] != "nvidia-mps"]
    pod["volumes"] = [v for v in pod["volumes"] if not v["name"].startswith("mps-")]
    pod["securityContext"].pop("supplementalGroups", None)
    pod.pop("tolerations")
    for c in pod["initContainers"] + pod["containers"]:
        c.pop("image")
        c["env"] = [e for e in c.get("env", []) if not e["name"].startswith(("CUDA_", "PYTORCH_"))]
        c["volumeMounts"] = [m for m in c["volumeMounts"] if not m["name"].startswith("mps-")]
        if "--speculative-config" in c.get("args", []):  # the draft's attention backend is the platform's choice
            i = c["args"].index("--speculative-config") + 1
            spec = json.loads(c["args"][i])
            spec.pop("attention_backend", None)
            c["args"][i] = json.dumps(spec, sort_keys=True)
    return dep


def test_amd_and_nvidia_variants_differ_only_in_vendor_pieces():
    amd, nvidia = load_variant("amd"), load_variant("nvidia")
    assert json.dumps(_vendor_neutral(amd), sort_keys=True) == json.dumps(_vendor_neutral(nvidia), sort_keys=True)
    assert amd.one("ConfigMap") == nvidia.one("ConfigMap")


# Where each JIT compiler keeps its kernels: Triton reads TRITON_CACHE_DIR (else ~/.triton/cache) and
# FlyDSL FLYDSL_RUNTIME_CACHE_DIR (else ~/.flydsl/cache); neither reads XDG_CACHE_HOME.
JIT_CACHE_ENV = ("TRITON_CACHE_DIR", "FLYDSL_RUNTIME_CACHE_DIR")


def test_the_jit_caches_are_on_the_cache_volume(variant):
    """With HOME=/tmp both caches went to the 1 GiB `sidecar-tmp` emptyDir, past whose sizeLimit kubelet
    evicts the pod, not to the 8 GiB `sidecar-cache` that the manifest's comment said held them."""
    sidecar = variant.container("dspark-sidecar")
    cache = mounts_of(sidecar)["sidecar-cache"]
    env = env_of(sidecar)
    for name in JIT_CACHE_ENV:
        assert Path(env[name]["value"]).is_relative_to(cache), (name, env.get(name))
