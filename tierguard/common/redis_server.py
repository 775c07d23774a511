"""A private `redis-server` (the Debian package) on a free loopback port, for tests and benches.

Real Redis, never a fake: the shared gate limits and the remote KV tier are judged
against the server users run. Each instance gets its own temporary directory and no
persistence, listens on 127.0.0.1 only, and is stopped (or killed with SIGKILL, the
crash case) by its owner; `restart()` brings it back on the same port, empty.

    with RedisServer() as r:
        r.url            # redis://127.0.0.1:PORT/0
        r.kill()         # SIGKILL
        r.restart()      # same port, fresh data

`redis_server_path()` is None when the package is missing: tests skip and say so
(`apt-get install redis-server`; `make test` installs it when run as root).

AUTH and TLS, as production Redis runs:

    RedisServer(password="pw")                     # requirepass: redis://:pw@127.0.0.1:PORT/0
    RedisServer(user=("tg", "pw"))                 # an ACL user (the default user is off)
    RedisServer(tls=True)                          # TLS only: rediss://...?ssl_ca_certs=CA
    RedisServer(tls=True, tls_client_auth=True)    # and a client certificate is required

For TLS a throwaway CA, server certificate (127.0.0.1, localhost) and client certificate
are made in the server's temporary directory (`make_test_certs`); `url` names them in the
query the way redis-py reads it (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`,
`ssl_cert_reqs`).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

INSTALL_HINT = "needs redis-server (Debian package redis-server: apt-get install -y redis-server)"


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(port: int, timeout_s: float = 0.2, tls: ssl.SSLContext | None = None) -> bool:
    """One `PING` over a raw socket (TLS with `tls`): True on `+PONG`, or on `-NOAUTH`
    from a server that wants a password (it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw:
            s = tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls is not None else raw
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def make_test_certs(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client
    certificate, all signed by the CA, as PEM files in `directory` (keys mode 0600)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path: Path, data: bytes, private: bool = False) -> Path:
        path.write_bytes(data)
        if private:
            path.chmod(0o600)
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("tierguard test CA")).issuer_name(name("tierguard test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    out = {"ca": write(directory / "ca.pem", ca.public_bytes(serialization.Encoding.PEM))}
    for role, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(f"tierguard test {role}")).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if role == "server":
            import ipaddress

            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        out[f"{role}_cert"] = write(directory / f"{role}.pem", cert.public_bytes(serialization.Encoding.PEM))
        out[f"{role}_key"] = write(directory / f"{role}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), True)
    return out


class RedisServer:
    def __init__(self, port: int | None = None, *, maxmemory: str | None = None, extra: list[str] | None = None,
                 password: str | None = None, user: tuple[str, str] | None = None, tls: bool = False,
                 tls_client_auth: bool = False):
        self.binary = redis_server_path()
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.extra = list(extra or [])
        self.password = password
        self.user = user
        self.tls = tls or tls_client_auth
        self.tls_client_auth = tls_client_auth
        self.certs: dict[str, Path] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """What a client names: credentials and, under TLS, the CA (and client certificate)."""
        auth = f"{self.user[0]}:{self.user[1]}@" if self.user else f":{self.password}@" if self.password else ""
        base = f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"
        if not self.tls:
            return base
        query = f"?ssl_cert_reqs=required&ssl_ca_certs={self.certs['ca']}"
        if self.tls_client_auth:
            query += f"&ssl_certfile={self.certs['client_cert']}&ssl_keyfile={self.certs['client_key']}"
        return base + query

    def _auth_args(self) -> list[str]:
        args = ["--requirepass", self.password] if self.password else []
        if self.user:
            args += ["--user", self.user[0], "on", f">{self.user[1]}", "~*", "&*", "+@all", "--user", "default", "off"]
        return args

    def _tls_args(self, d: Path) -> tuple[list[str], ssl.SSLContext | None]:
        if not self.tls:
            return ["--port", str(self.port)], None
        if not self.certs:
            self.certs = make_test_certs(d)
        c = self.certs
        ctx = ssl.create_default_context(cafile=str(c["ca"]))
        if self.tls_client_auth:
            ctx.load_cert_chain(str(c["client_cert"]), str(c["client_key"]))
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(c["server_cert"]),
                "--tls-key-file", str(c["server_key"]), "--tls-ca-cert-file", str(c["ca"]),
                "--tls-auth-clients", "yes" if self.tls_client_auth else "no"], ctx

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tierguard-redis-")
        d = Path(self._tmp.name)
        listen, tls = self._tls_args(d)
        args = [self.binary, *listen, "--bind", "127.0.0.1", "--dir", str(d),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", str(d / "redis.log"), *self._auth_args(), *self.extra]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if ping(self.port, tls=tls):
                return self
            time.sleep(0.02)
        log = (d / "redis.log").read_text(errors="replace")[-500:] if (d / "redis.log").exists() else ""
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING: {log}")

    def kill(self) -> None:
        """SIGKILL: the crash case (nothing is saved; the port is free at once)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
