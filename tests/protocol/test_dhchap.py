"""DH-HMAC-CHAP secrets (the DHHC-1 format, its CRC-32 and transform), ``blockctl
gen-dhchap-key`` against nvme-cli, the FFDHE primes against OpenSSL's, and the DH exchange."""

from __future__ import annotations

import base64
import shutil
import subprocess

import pytest

from blockd.cli.blockctl import main as blockctl
from blockd.dhchap import DhError, DhExchange, augment, controller_response, host_response
from blockd.dhchap_secret import Secret, SecretError, generate_secret, parse_secret
from blockd.ffdhe import PRIMES

SEED = bytes(range(32))
NQN = "nqn.2014-08.org.nvmexpress:uuid:test"
# printed by nvme-cli 2.3 (`nvme gen-dhchap-key --secret 0001..1f --hmac 1 --nqn NQN`, and
# `--hmac 0`): the transform is HMAC-SHA-256(seed, NQN || "NVMe-over-Fabrics")
NVME_CLI_HMAC1 = "DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:"
NVME_CLI_PLAIN = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"


def test_generate_matches_nvme_cli():
    assert generate_secret(NQN, 1, 0, SEED).encode() == NVME_CLI_HMAC1
    assert generate_secret("nqn.x", 0, 32, SEED).encode() == NVME_CLI_PLAIN


def test_blockctl_gen_dhchap_key(capsys):
    assert blockctl(["gen-dhchap-key", "-s", SEED.hex(), "-m", "1", "-n", NQN]) == 0
    assert capsys.readouterr().out.strip() == NVME_CLI_HMAC1
    assert blockctl(["gen-dhchap-key", "-m", "2", "-l", "32", "-n", NQN]) == 1


@pytest.mark.skipif(shutil.which("nvme") is None, reason="nvme-cli not installed")
@pytest.mark.parametrize("hmac_id, length", [(0, 48), (2, 48), (3, 64)])
def test_generate_matches_installed_nvme_cli(hmac_id, length):
    seed = bytes(range(100, 100 + length))
    out = subprocess.run(["nvme", "gen-dhchap-key", "-s", seed.hex(), "-m", str(hmac_id),
                          "-l", str(length), "-n", NQN], capture_output=True, text=True, check=True)
    assert generate_secret(NQN, hmac_id, length, seed).encode() == out.stdout.strip()


def test_parse_checks_crc_and_length():
    secret = parse_secret(NVME_CLI_HMAC1)
    assert secret.transform == 1 and len(secret.key) == 32
    assert secret.encode() == NVME_CLI_HMAC1
    blob = bytearray(base64.b64decode(NVME_CLI_HMAC1.split(":")[2]))
    blob[0] ^= 1                                     # one flipped key bit: the CRC catches it
    with pytest.raises(SecretError, match="CRC"):
        parse_secret(f"DHHC-1:01:{base64.b64encode(bytes(blob)).decode()}:")
    for bad in ("DHHC-1:01:" + base64.b64encode(bytes(20)).decode() + ":",   # 16-byte key
                "DHHC-2:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
                "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR",
                "DHHC-1:07:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
                "DHHC-1:00:not*base64:"):
        with pytest.raises(SecretError):
            parse_secret(bad)


def test_secret_never_shows_its_key():
    secret = parse_secret(NVME_CLI_PLAIN)
    for text in (repr(secret), str(secret), f"{secret}"):
        assert SEED.hex() not in text and "AAECAw" not in text


def test_transform_is_hmac_of_the_nqn():
    plain = Secret(SEED, 0)
    assert plain.transformed(NQN) == SEED
    # transforming the seed with hash 1 is what nvme-cli stored above
    assert Secret(SEED, 1).transformed(NQN) == parse_secret(NVME_CLI_HMAC1).key
    assert Secret(SEED, 1).transformed(NQN + "x") != parse_secret(NVME_CLI_HMAC1).key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
@pytest.mark.parametrize("bits", sorted(PRIMES))
def test_ffdhe_primes_are_openssls(bits, tmp_path):
    from cryptography.hazmat.primitives.serialization import load_pem_parameters
    pem = tmp_path / "p.pem"
    subprocess.run(["openssl", "genpkey", "-genparam", "-algorithm", "DH", "-pkeyopt",
                    f"group:ffdhe{bits}", "-out", str(pem)], check=True, capture_output=True)
    numbers = load_pem_parameters(pem.read_bytes()).parameter_numbers()
    assert (numbers.p, numbers.g) == (PRIMES[bits], 2)


def test_dh_exchange_agrees_and_refuses_bad_values():
    a, b = DhExchange(1), DhExchange(1)
    assert len(a.public) == 256
    assert a.session_key(b.public) == b.session_key(a.public)
    p = PRIMES[2048]
    for bad in (bytes(255), bytes(257), bytes(256), (1).to_bytes(256, "big"),
                (p - 1).to_bytes(256, "big"), p.to_bytes(256, "big")):
        with pytest.raises(DhError):
            a.session_key(bad)


def test_responses_bind_every_input():
    key, c = bytes(32), bytes(range(32))
    base = host_response(1, key, c, 5, 7, 0, "h", "s")
    assert len(base) == 32 and len(host_response(3, bytes(64), c, 5, 7, 0, "h", "s")) == 64
    for changed in (host_response(1, b"\1" * 32, c, 5, 7, 0, "h", "s"),
                    host_response(1, key, c[::-1], 5, 7, 0, "h", "s"),
                    host_response(1, key, c, 6, 7, 0, "h", "s"),
                    host_response(1, key, c, 5, 8, 0, "h", "s"),
                    host_response(1, key, c, 5, 7, 0, "h2", "s"),
                    host_response(1, key, c, 5, 7, 0, "h", "s2"),
                    controller_response(1, key, c, 5, 7, "h", "s")):
        assert changed != base
    assert augment(1, None, c) == c
    assert augment(1, b"session", c) != c
