"""Certificates for the S3 tests' HTTPS server, made fresh by each test session with ``cryptography``:
a self-signed certificate authority, a server certificate for 127.0.0.1 signed by it, and an
unrelated authority that signed nothing (the wrong CA)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    """PEM of the authority that signed the server's certificate: what AWS_CA_BUNDLE should name."""
    wrong_ca: str
    """PEM of an authority that signed nothing here."""
    cert: str
    key: str


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _authority(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def make(directory: str) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and localhost signed by it, and a wrong CA, as PEM
    files in ``directory``."""
    ca_key, ca_cert = _authority("bcp test CA")
    _, wrong_cert = _authority("bcp test CA that signed nothing")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return TlsFiles(
        ca=_write(os.path.join(directory, "ca.pem"), ca_cert.public_bytes(pem)),
        wrong_ca=_write(os.path.join(directory, "wrong-ca.pem"), wrong_cert.public_bytes(pem)),
        cert=_write(os.path.join(directory, "server.pem"), cert.public_bytes(pem)),
        key=_write(os.path.join(directory, "server.key"), key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())))
