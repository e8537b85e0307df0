"""Bearer-token auth and TLS (and mutual TLS) on both transports."""

from __future__ import annotations

import datetime
import ipaddress
import ssl

import grpc
import httpx
import pytest

from proctor.proto import scoring_pb2, scoring_pb2_grpc

TOKEN = "s3cret-token"
REQUEST = scoring_pb2.ScoreRequest(token_ids=[1, 2, 3], logprobs=True)


def _server(model_dir, **options):
    from proctor.server.config import single_teacher_router
    from proctor.server.engines.base import EngineSpec
    from proctor.server.front.runtime import ServerThread
    from proctor.server.front.settings import ServerOptions

    spec = EngineSpec(name="torch", model_path=str(model_dir))
    return ServerThread(single_teacher_router(spec, name="tiny"), ServerOptions(grpc_port=0, http_port=0, **options))


@pytest.fixture(scope="module")
def auth_server(tiny_model_dir):
    with _server(tiny_model_dir, auth_token=TOKEN) as server:
        yield server


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
def test_grpc_refuses_missing_or_wrong_tokens(auth_server, header):
    stub = scoring_pb2_grpc.TeacherScoringStub(grpc.insecure_channel(auth_server.grpc_target))
    metadata = (("authorization", header),) if header else None
    for call in (lambda: stub.Score(REQUEST, metadata=metadata),
                 lambda: list(stub.ScoreStream(REQUEST, metadata=metadata)),
                 lambda: stub.ListTeachers(scoring_pb2.TeachersRequest(), metadata=metadata)):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_accepts_the_right_token_and_leaves_health_open(auth_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(auth_server.grpc_target)
    stub = scoring_pb2_grpc.TeacherScoringStub(channel)
    assert stub.Score(REQUEST, metadata=(("authorization", f"Bearer {TOKEN}"),)).num_tokens == 3
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("header", [None, "Bearer wrong", TOKEN])
def test_http_refuses_missing_or_wrong_tokens(auth_server, header):
    headers = {"authorization": header} if header else {}
    for method, path in (("POST", "/v1/score"), ("GET", "/v1/teachers")):
        reply = httpx.request(method, auth_server.http_url + path, json={"token_ids": [1, 2]}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "UNAUTHENTICATED"


def test_http_accepts_the_right_token_and_leaves_health_and_metrics_open(auth_server):
    ok = httpx.post(auth_server.http_url + "/v1/score", json={"token_ids": [1, 2]},
                    headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    for path in ("/health/live", "/health/ready", "/metrics"):
        assert httpx.get(auth_server.http_url + path).status_code == 200


def test_closed_metrics_need_the_token(tiny_model_dir):
    with _server(tiny_model_dir, auth_token=TOKEN, open_paths=("/health/live", "/health/ready")) as server:
        assert httpx.get(server.http_url + "/metrics").status_code == 401
        assert httpx.get(server.http_url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_token_loads_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from proctor.server.front.auth import load_token

    (tmp_path / "token").write_text(" from-file \n")
    assert load_token(token_file=str(tmp_path / "token")) == "from-file"
    monkeypatch.setenv("PROCTOR_AUTH_TOKEN", "from-env")
    assert load_token() == "from-env"
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_token(token_file=str(tmp_path / "empty"))


# -- TLS ----------------------------------------------------------------------------------

def _certificates(directory):
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all made here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def make(name, issuer_key=None, issuer_name=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return key, cert

    def write(stem, key, cert):
        (directory / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    ca_key, ca_cert = make("proctor-test-ca", ca=True)
    write("ca", ca_key, ca_cert)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    write("server", *make("localhost", ca_key, ca_cert.subject, san=san))
    write("client", *make("trainer", ca_key, ca_cert.subject))
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _certificates(tmp_path_factory.mktemp("certs"))


def test_tls_serves_both_transports_and_refuses_plaintext(tiny_model_dir, certs):
    with _server(tiny_model_dir, tls_cert_file=str(certs / "server.pem"), tls_key_file=str(certs / "server.key")) as server:
        creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        with grpc.secure_channel(server.grpc_target, creds) as channel:
            assert scoring_pb2_grpc.TeacherScoringStub(channel).Score(REQUEST).num_tokens == 3
        with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError):
            scoring_pb2_grpc.TeacherScoringStub(channel).Score(REQUEST, timeout=5)
        url = server.http_url.replace("http://", "https://")
        reply = httpx.post(url + "/v1/score", json={"token_ids": [1, 2]}, verify=ssl.create_default_context(cafile=str(certs / "ca.pem")))
        assert reply.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.post(server.http_url + "/v1/score", json={"token_ids": [1, 2]}, timeout=5)


def test_mutual_tls_requires_a_client_certificate(tiny_model_dir, certs):
    with _server(tiny_model_dir, tls_cert_file=str(certs / "server.pem"), tls_key_file=str(certs / "server.key"),
                 tls_client_ca_file=str(certs / "ca.pem")) as server:
        ca = (certs / "ca.pem").read_bytes()
        with_client = grpc.ssl_channel_credentials(ca, (certs / "client.key").read_bytes(), (certs / "client.pem").read_bytes())
        with grpc.secure_channel(server.grpc_target, with_client) as channel:
            assert scoring_pb2_grpc.TeacherScoringStub(channel).Score(REQUEST).num_tokens == 3
        with grpc.secure_channel(server.grpc_target, grpc.ssl_channel_credentials(ca)) as channel, pytest.raises(grpc.RpcError):
            scoring_pb2_grpc.TeacherScoringStub(channel).Score(REQUEST, timeout=5)
        url = server.http_url.replace("http://", "https://")
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        assert httpx.post(url + "/v1/score", json={"token_ids": [1, 2]}, verify=context).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.post(url + "/v1/score", json={"token_ids": [1, 2]},
                       verify=ssl.create_default_context(cafile=str(certs / "ca.pem")), timeout=5)
