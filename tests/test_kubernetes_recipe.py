"""The Kubernetes recipe behind llm-d's endpoint picker (examples/kubernetes/inference-gateway).

Three things must hold for the picker to route to these pods, and each is
checked here:

- the manifests are valid: Kubernetes' own schemas for its kinds (the
  `kubernetes-validate` package's), the projects' CRD schemas for the
  InferencePool, Gateway and HTTPRoute (tests/schemas/, SOURCES.md there),
  unknown fields refused as `kubectl apply` refuses them; and they agree with
  each other and with the launcher (ports, names, probes, the drain budget);
- what the picker reads is served: the proto fields it decodes (from this
  package's descriptors), and, from a launcher started with the Deployment's
  own arguments, the series it scores on with the labels it parses, on the
  metrics port, and answers it can parse: messages never compressed (the
  picker refuses compressed frames) carrying the token counts it reads.

The picker's side is llm-d-router v0.10.0: the vllmgrpc parser
(pkg/epp/framework/plugins/requesthandling/parsers/vllmgrpc), its metrics
extractor (pkg/epp/framework/plugins/datalayer/extractor/metrics) and its
default vLLM metric names (pkg/epp/server/options.go).
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import request
from support.h2_grpc import raw_call
from support.launcher import EXAMPLES, START_TIMEOUT
from support.recipe import RecipeLauncher, flag_value, manifests, server_container

from vllm_servicer import SERVICE_NAME
from vllm_servicer.drain import _ABORT_FLUSH_SECONDS, _ENGINE_SHUTDOWN_SECONDS
from vllm_servicer.health import LIVENESS_SERVICE
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.serve.args import parse_args

KUBERNETES = "1.31"
"""The Kubernetes release whose schemas the built-in kinds are checked against."""

SCHEMAS = Path(__file__).resolve().parent / "schemas"

WITHOUT_SCHEMA = {("monitoring.coreos.com/v1", "ServiceMonitor")}
"""Kinds in examples/kubernetes/ with no schema here (the Prometheus Operator's CRD)."""

PICKER_PATHS = ("/vllm.grpc.engine.VllmEngine/Generate", "/vllm.grpc.engine.VllmEngine/Embed")
"""The methods the picker's vllmgrpc parser decodes; it passes every other one through."""

PICKER_FIELDS = {
    "GenerateRequest": ("text", "tokenized", "stream", "mm_inputs"),
    "TokenizedInput": ("input_ids",),
    "MultimodalInputs": ("mm_placeholders", "mm_hashes"),
    "GenerateResponse": ("chunk", "complete"),
    "GenerateStreamChunk": ("token_ids", "prompt_tokens", "completion_tokens", "cached_tokens"),
    "GenerateComplete": ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"),
    "EmbedRequest": ("tokenized",),
    "EmbedResponse": ("embedding", "prompt_tokens"),
}
"""Every field of vllm_engine.proto the picker reads, by message."""

PICKER_SERIES = {
    "vllm:num_requests_waiting": (),
    "vllm:num_requests_running": (),
    "vllm:kv_cache_usage_perc": (),
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
    "vllm:lora_requests_info": ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
}
"""The series the picker scrapes for vLLM pods, and the labels it parses on each."""

PICKER_INT_LABELS = {"block_size", "num_gpu_blocks", "max_lora"}
"""Labels the picker parses as integers: one that does not parse leaves its metric unset."""


# ----- schemas ---------------------------------------------------------------------


def _documents() -> list[tuple[str, dict[str, Any]]]:
    """Every object in examples/kubernetes/, with the file it is in."""
    found = []
    for path in sorted((EXAMPLES / "kubernetes").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((str(path.relative_to(EXAMPLES)), doc))
    return found


def _strict(schema: Any) -> Any:
    """A CRD's schema with unknown fields refused, as the API server's strict field
    validation (kubectl's default) refuses them; pruning would drop them silently."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_schema(api_version: str, kind: str) -> dict[str, Any] | None:
    group, _, version = api_version.rpartition("/")
    path = SCHEMAS / f"{kind}-{group}-{version}.json".lower()
    return _strict(json.loads(path.read_text())) if path.exists() else None


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` does not validate against its kind's schema (none found: too)."""
    schema = _crd_schema(obj["apiVersion"], obj["kind"])
    if schema is None:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        return
    jsonschema.Draft7Validator(schema).validate(obj)
    # A CRD's schema leaves metadata to the API server: ObjectMeta's own schema,
    # reached through a kind that has nothing else.
    meta_only = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    kubernetes_validate.validate(meta_only, KUBERNETES, strict=True)


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(o, id=f"{p}:{o['kind']}/{o['metadata']['name']}")
        for p, o in _documents()
        if (o["apiVersion"], o["kind"]) not in WITHOUT_SCHEMA
    ],
)
def test_every_manifest_validates(obj: dict[str, Any]) -> None:
    validate(obj)  # a kind without a schema fails too (SchemaNotFoundError)


def test_every_recipe_kind_has_a_schema() -> None:
    kinds = {(o["apiVersion"], o["kind"]) for p, o in _documents() if "inference-gateway" in p}
    assert kinds.isdisjoint(WITHOUT_SCHEMA)
    assert ("inference.networking.k8s.io/v1", "InferencePool") in kinds


def _edit(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    edited = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node = edited
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return edited


@pytest.mark.parametrize(
    ("file", "kind", "path", "value"),
    [
        ("inferencepool.yaml", "InferencePool", "spec.appProtocol", "grpc"),
        ("inferencepool.yaml", "InferencePool", "spec.targetPort", 50051),
        ("inferencepool.yaml", "InferencePool", "spec.endpointPickerRef.failureMode", "Open"),
        ("gateway.yaml", "HTTPRoute", "spec.rules.0.timeouts.request", "forever"),
        ("gateway.yaml", "HTTPRoute", "spec.rules.0.backendRef", []),
        ("gateway.yaml", "Gateway", "spec.listeners.0.port", 0),
        ("deployment.yaml", "Deployment", "spec.template.spec.terminationGracePeriod", 100),
        ("epp.yaml", "Service", "spec.ports.0.appProtocl", "kubernetes.io/h2c"),
        ("inferencepool.yaml", "InferencePool", "metadata.label", {}),
    ],
)
def test_the_validation_refuses_what_a_cluster_would(
    file: str, kind: str, path: str, value: Any
) -> None:
    [obj] = [o for o in manifests(file) if o["kind"] == kind]
    validate(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(_edit(obj, path, value))


# ----- the objects agree -------------------------------------------------------------


def _one(file: str, kind: str) -> dict[str, Any]:
    [obj] = [o for o in manifests(file) if o["kind"] == kind]
    return obj


def _picker_config() -> dict[str, Any]:
    config_map = _one("epp.yaml", "ConfigMap")
    [text] = config_map["data"].values()
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def _port(container: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def test_the_launcher_takes_the_deployments_arguments_and_serves_its_ports() -> None:
    container = server_container()
    args = parse_args(container["args"])  # every flag exists, none contradicts another
    assert args.server.host == "0.0.0.0"
    assert args.server.port == _port(container, "grpc")
    assert args.observability.metrics_port == _port(container, "metrics")
    assert args.security.api_key_file  # the gateway passes the client's authorization header on
    # vllm:lora_requests_info, which the picker reads, exists only with LoRA on.
    assert args.engine["enable_lora"] is True
    deployment = _one("deployment.yaml", "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.observability.metrics_port


def test_probes_are_grpc_health_on_the_serving_port() -> None:
    container = server_container()
    port = _port(container, "grpc")
    probes = {
        name: container[name]["grpc"]
        for name in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert {p["port"] for p in probes.values()} == {port}
    assert probes["startupProbe"].get("service", "") == ""
    # The picker keeps Ready pods only: a drain, a dead or a paused engine turns
    # this NOT_SERVING and the pod leaves the picker's choice.
    assert probes["readinessProbe"]["service"] == SERVICE_NAME
    # SERVING through a drain: the pod is not restarted mid-drain.
    assert probes["livenessProbe"]["service"] == LIVENESS_SERVICE


def test_the_drain_fits_the_grace_period_and_the_probe() -> None:
    container = server_container()
    args = parse_args(container["args"])
    pod = _one("deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    # The launcher's own ceiling for a stop (drain.py): never cut by SIGKILL first.
    ceiling = (
        args.server.drain_grace
        + args.engine["shutdown_timeout"]
        + 2 * _ABORT_FLUSH_SECONDS
        + _ENGINE_SHUTDOWN_SECONDS
    )
    assert pod["terminationGracePeriodSeconds"] >= ceiling
    # New calls keep being served until the probe has seen NOT_SERVING.
    readiness = container["readinessProbe"]
    assert args.server.drain_grace > readiness["periodSeconds"] * readiness["failureThreshold"]
    picker_pod = _one("epp.yaml", "Deployment")["spec"]["template"]["spec"]
    assert picker_pod["terminationGracePeriodSeconds"] >= pod["terminationGracePeriodSeconds"]


def test_the_pool_selects_the_pods_over_h2c_and_names_the_picker() -> None:
    pool = _one("inferencepool.yaml", "InferencePool")["spec"]
    pod_labels = _one("deployment.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_labels["llm-d.ai/engine-type"] == "vllm"  # vLLM's metric names
    assert [p["number"] for p in pool["targetPorts"]] == [_port(server_container(), "grpc")]
    assert pool["appProtocol"] == "kubernetes.io/h2c"
    picker_service = _one("epp.yaml", "Service")
    assert pool["endpointPickerRef"]["name"] == picker_service["metadata"]["name"]
    ext_proc = {p["port"] for p in picker_service["spec"]["ports"]}
    assert pool["endpointPickerRef"]["port"]["number"] in ext_proc
    picker = _one("epp.yaml", "Deployment")
    [container] = picker["spec"]["template"]["spec"]["containers"]
    pool_name = _one("inferencepool.yaml", "InferencePool")["metadata"]["name"]
    assert flag_value(container["args"], "--pool-name") == pool_name
    config = flag_value(container["args"], "--config-file")
    [mount] = container["volumeMounts"]
    assert config == f"{mount['mountPath']}/{next(iter(_one('epp.yaml', 'ConfigMap')['data']))}"


def test_the_picker_scrapes_the_metrics_port_and_parses_vllm_grpc() -> None:
    config = _picker_config()
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    source = next(p for p in plugins.values() if p["type"] == "metrics-data-source")
    args = parse_args(server_container()["args"])
    # Without `port` the picker scrapes the pool's target port, which speaks gRPC only.
    assert source["parameters"]["port"] == args.observability.metrics_port
    assert source["parameters"]["path"] == "/metrics"
    assert source["parameters"]["scheme"] == "http"
    parsers = [p["pluginRef"] for p in config["requestHandler"]["parsers"]]
    assert plugins[parsers[0]]["type"] == "vllmgrpc-parser"
    # A parser that claims no path takes the rest; first it would take them all.
    assert plugins[parsers[-1]]["type"] == "passthrough-parser"
    referenced = {
        p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]
    }
    assert referenced | set(parsers) <= set(plugins)


def test_the_route_sends_the_pickers_methods_to_the_pool() -> None:
    route = _one("gateway.yaml", "HTTPRoute")
    gateway = _one("gateway.yaml", "Gateway")
    assert route["spec"]["parentRefs"][0]["name"] == gateway["metadata"]["name"]
    pool_name = _one("inferencepool.yaml", "InferencePool")["metadata"]["name"]
    [rule] = route["spec"]["rules"]
    [backend] = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool_name,
    )
    prefixes = [m["path"]["value"] for m in rule["matches"] if m["path"]["type"] == "PathPrefix"]
    for path in PICKER_PATHS:
        assert any(path.startswith(prefix) for prefix in prefixes), path


def test_the_fields_the_picker_reads_are_in_the_proto() -> None:
    for message, fields in PICKER_FIELDS.items():
        descriptor = pb.DESCRIPTOR.message_types_by_name[message]
        missing = set(fields) - set(descriptor.fields_by_name)
        assert not missing, f"{message} lacks {missing}"
    service = pb.DESCRIPTOR.services_by_name["VllmEngine"]
    served = {f"/{service.full_name}/{method.name}" for method in service.methods}
    assert set(PICKER_PATHS) <= served


# ----- a launcher with the Deployment's arguments ------------------------------------


def _scrape(url: str) -> dict[str, list[dict[str, Any]]]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples: dict[str, list[dict[str, Any]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append({**sample.labels, "_value": sample.value})
    return samples


@pytest.mark.timeout(START_TIMEOUT + 180)
async def test_the_metrics_port_serves_what_the_picker_scores_on(
    recipe_launcher: RecipeLauncher,
) -> None:
    samples = await asyncio.to_thread(_scrape, recipe_launcher.served.metrics_url)
    for name, labels in PICKER_SERIES.items():
        assert samples.get(name), f"{name} is not on the metrics port"
        for sample in samples[name]:
            assert set(labels) <= set(sample), (name, sample)
            for label in PICKER_INT_LABELS.intersection(labels):
                assert sample[label].isdigit(), (name, label, sample[label])
            assert isinstance(sample["_value"], float)
    # The gRPC port answers no HTTP/1.1 scrape: hence the picker's `port`.
    with pytest.raises((OSError, http.client.HTTPException)):
        await asyncio.to_thread(_scrape, f"http://{recipe_launcher.served.address}/metrics")


@pytest.mark.timeout(START_TIMEOUT + 180)
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "unary"])
async def test_answers_are_uncompressed_and_carry_the_counts_the_picker_reads(
    recipe_launcher: RecipeLauncher, stream: bool
) -> None:
    prompt = [5, 17, 42, 99, 7, 63, 21, 88]
    generate = request(prompt, stream=stream, max_tokens=6, ignore_eos=True)
    reply = await raw_call(
        recipe_launcher.served.address,
        PICKER_PATHS[0],
        generate.SerializeToString(),
        [
            # What grpc clients send, and a proxy passes on: compression offered.
            ("grpc-accept-encoding", "identity,deflate,gzip"),
            ("authorization", f"Bearer {recipe_launcher.api_key}"),
        ],
    )
    assert reply.status == 0, reply.trailers
    assert reply.headers.get("grpc-encoding", "identity") == "identity", reply.headers
    assert reply.messages and not any(reply.compressed), reply.compressed
    messages = [pb.GenerateResponse.FromString(payload) for payload in reply.messages]
    chunks = [m.chunk for m in messages if m.HasField("chunk")]
    [complete] = [m.complete for m in messages if m.HasField("complete")]
    # The picker takes usage from any chunk or complete whose counts are not zero.
    assert complete.prompt_tokens == len(prompt)
    assert complete.completion_tokens == len(complete.output_ids) > 0
    # Eight tokens, less than one KV block: nothing the prefix cache can reuse,
    # however often the prompt was sent (a count that is not zero is the
    # engine's, passed through: tests/test_disaggregation.py).
    assert complete.cached_tokens == 0
    assert all(c.cached_tokens == 0 for c in chunks)
    if stream:
        # Each chunk counts its own step; the complete, its last step again
        # (vLLM's protocol: clients add up the chunks).
        assert chunks and all(c.prompt_tokens == len(prompt) for c in chunks)
        assert all(c.completion_tokens == len(c.token_ids) for c in chunks)
        assert sum(c.completion_tokens for c in chunks) == 6
    else:
        assert not chunks and complete.completion_tokens == 6
