"""--health-port: plaintext health beside a TLS-only launcher, for Kubernetes' gRPC probes."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import request
from support.certs import CertificateAuthority
from support.launcher import START_TIMEOUT, launched, launcher_env

from vllm_servicer.health import LIVENESS_SERVICE
from vllm_servicer.proto import SERVICE_NAME, vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(START_TIMEOUT + 180)

SERVING = health_pb2.HealthCheckResponse.SERVING


async def test_probes_reach_health_in_plaintext_and_nothing_else(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = tmp_path_factory.mktemp("probe-port")
    cert, key = CertificateAuthority("probe-ca").server().write(folder, "server")
    env = launcher_env(tmp_path_factory.mktemp("cache"))
    flags = ("--tls-cert", str(cert), "--tls-key", str(key), "--health-port", "0")
    async with launched(*flags, env=env) as served:
        async with grpc.aio.insecure_channel(served.probe_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME, LIVENESS_SERVICE):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == SERVING, service
            # The probe port serves health only: no engine call reaches it.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await (
                    vllm_engine_pb2_grpc.VllmEngineStub(channel)
                    .Generate(request(max_tokens=1))
                    .read()
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The main port stays TLS-only: a plaintext probe there fails.
        async with grpc.aio.insecure_channel(served.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_probe_port_is_refused_without_tls() -> None:
    from vllm_servicer.serve.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["serve", "--model", "m", "--health-port", "8081"])
    args = parse_args(["serve", "--model", "m", "--health-port", "8081",
                       "--tls-cert", "c.pem", "--tls-key", "k.pem"])  # fmt: skip
    assert args.security.health_port == 8081
