"""The certificate helpers' former home, kept for test files that import them from here.

They live in `support.certs`; import them from there.
"""

from support.certs import CertificateAuthority, Pem

__all__ = ["CertificateAuthority", "Pem"]
