"""Encrypted keystore files (SPEC.md section 5.4).

A keystore holds one Ed25519 seed, encrypted with a key that argon2id derives from
the operator's passphrase (nacl.pwhash) and sealed with XSalsa20-Poly1305
(nacl.secret.SecretBox). The file is versioned JSON; the KDF limits are recorded in
it, so a file made with cheap test limits still opens, and the public key is kept in
clear so `meshnode keys show` needs no passphrase (it is checked against the
decrypted seed on every load). Files are written atomically with mode 0600, and a
keystore readable by group or others is refused.
"""

from __future__ import annotations

import getpass
import json
import os
import stat
import sys
from dataclasses import dataclass

import nacl.exceptions
import nacl.pwhash.argon2id as argon2id
import nacl.secret
import nacl.utils

from keys.errors import KeystoreError
from keys.identity import PUBLIC_KEY_BYTES, SEED_BYTES, SigningIdentity

KEYSTORE_FORMAT = "meshnode-keystore"
KEYSTORE_VERSION = 1
MAX_KEYSTORE_BYTES = 64 * 1024
MAX_PASSPHRASE_BYTES = 1024
KDF_ENV = "MESHNODE_KEYSTORE_KDF"  # picks a KdfLimits profile for new keystores
INSECURE_WARNING = "WARNING: keystore %s is NOT encrypted (--insecure-no-passphrase); use it on testnets only"


@dataclass(frozen=True)
class KdfLimits:
    opslimit: int
    memlimit: int


# "moderate" is libsodium's recommendation for keys that matter (about 1 s, 256 MiB);
# "interactive" is for demos; "insecure-test" exists only to keep the test suite fast.
KDF_PROFILES = {
    "moderate": KdfLimits(argon2id.OPSLIMIT_MODERATE, argon2id.MEMLIMIT_MODERATE),
    "interactive": KdfLimits(argon2id.OPSLIMIT_INTERACTIVE, argon2id.MEMLIMIT_INTERACTIVE),
    "insecure-test": KdfLimits(argon2id.OPSLIMIT_MIN, argon2id.MEMLIMIT_MIN),
}
# Limits read from a file are bounded so a crafted keystore cannot make a load take
# minutes or gigabytes.
MAX_OPSLIMIT = 16
MAX_MEMLIMIT = 1 << 30


def kdf_limits_from_env() -> KdfLimits:
    name = os.environ.get(KDF_ENV, "moderate")
    if name not in KDF_PROFILES:
        raise KeystoreError("%s=%s: expected one of %s" % (KDF_ENV, name, ", ".join(KDF_PROFILES)))
    return KDF_PROFILES[name]


# --- passphrases ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PassphraseSource:
    """Where a passphrase comes from: an interactive prompt, a file, an env var or a value."""
    kind: str  # "prompt" | "file" | "env" | "value"
    where: str = ""
    value: bytes = b""

    @classmethod
    def prompt(cls) -> "PassphraseSource":
        return cls("prompt")

    @classmethod
    def from_file(cls, path: str) -> "PassphraseSource":
        return cls("file", where=str(path))

    @classmethod
    def from_env(cls, name: str) -> "PassphraseSource":
        return cls("env", where=name)

    @classmethod
    def literal(cls, passphrase: bytes | str) -> "PassphraseSource":
        """For programs that already hold the passphrase (testnet launchers, tests)."""
        if isinstance(passphrase, str):
            passphrase = passphrase.encode("utf-8")
        return cls("value", value=passphrase)

    def read(self, keystore_path: str, confirm: bool = False) -> bytes:
        """Return the passphrase; ``confirm`` asks twice at an interactive prompt."""
        if self.kind == "prompt":
            passphrase = self._prompt(keystore_path, confirm)
        elif self.kind == "file":
            passphrase = self._read_file()
        elif self.kind == "env":
            if self.where not in os.environ:
                raise KeystoreError("environment variable %s (the passphrase) is not set" % self.where)
            passphrase = os.environ[self.where].encode("utf-8")
        else:
            passphrase = self.value
        if not passphrase:
            raise KeystoreError("the passphrase is empty")
        if len(passphrase) > MAX_PASSPHRASE_BYTES:
            raise KeystoreError("the passphrase is longer than %d bytes" % MAX_PASSPHRASE_BYTES)
        return passphrase

    def _read_file(self) -> bytes:
        try:
            with open(self.where, "rb") as fh:
                first_line = fh.read(MAX_PASSPHRASE_BYTES + 2).split(b"\n", 1)[0]
        except OSError as exc:
            raise KeystoreError("cannot read passphrase file %s: %s" % (self.where, exc.strerror)) from None
        return first_line.rstrip(b"\r")

    @staticmethod
    def _prompt(keystore_path: str, confirm: bool) -> bytes:
        # Without a terminal getpass cannot hide what is typed: it reads stdin anyway and
        # prints a GetPassWarning. A script pipes the passphrase in; no prompt, no noise.
        ask = getpass.getpass if _stdin_is_terminal() else _read_stdin_line
        try:
            first = ask("Passphrase for %s: " % keystore_path)
            if confirm and ask("Repeat the passphrase: ") != first:
                raise KeystoreError("the two passphrases differ")
        except EOFError:
            raise KeystoreError("no passphrase given (stdin closed); use --passphrase-file or --passphrase-env") from None
        return first.encode("utf-8")


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, ValueError, OSError):  # stdin closed, or replaced by an object without a descriptor
        return False


def _read_stdin_line(_prompt: str) -> str:
    """One line of a piped passphrase, without its newline; EOFError when stdin is empty."""
    line = sys.stdin.readline() if sys.stdin is not None else ""
    if not line:
        raise EOFError
    return line.rstrip("\r\n")


# --- files ----------------------------------------------------------------------------------

def write_file_atomic(path, data: bytes, *, mode: int = 0o600, overwrite: bool = False) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one, never half.

    Without ``overwrite`` an existing file is refused, atomically (os.link fails if the
    name exists), so two writers cannot both believe they created it.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not overwrite and os.path.lexists(path):
        raise KeystoreError("%s already exists; pass --force to overwrite it" % path)
    tmp = os.path.join(directory, ".%s.tmp-%s" % (os.path.basename(path), nacl.utils.random(6).hex()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # the umask may narrow the mode; never let it widen
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the new name durable, not only the bytes
        finally:
            os.close(dir_fd)
    except FileExistsError:
        raise KeystoreError("%s already exists; pass --force to overwrite it" % path) from None
    except OSError as exc:
        raise KeystoreError("cannot write %s: %s" % (path, exc.strerror)) from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


# --- keystore documents ---------------------------------------------------------------------

def encode_keystore(identity: SigningIdentity, passphrase: bytes | None,
                    limits: KdfLimits | None = None, salt: bytes | None = None,
                    nonce: bytes | None = None) -> bytes:
    """The keystore file bytes. ``passphrase=None`` makes an unencrypted (testnet) keystore.

    ``salt`` and ``nonce`` are random unless given (SPEC.md test vectors fix them).
    """
    document = {"format": KEYSTORE_FORMAT, "version": KEYSTORE_VERSION,
                "public_key": identity.public_key.hex()}
    if passphrase is None:
        document.update(encryption="none", seed=identity.seed.hex())
    else:
        limits = limits or kdf_limits_from_env()
        salt = salt if salt is not None else nacl.utils.random(argon2id.SALTBYTES)
        nonce = nonce if nonce is not None else nacl.utils.random(nacl.secret.SecretBox.NONCE_SIZE)
        box = nacl.secret.SecretBox(_derive_key(passphrase, salt, limits))
        ciphertext = box.encrypt(identity.seed, nonce).ciphertext
        document.update(
            encryption="xsalsa20poly1305",
            kdf={"name": "argon2id", "opslimit": limits.opslimit, "memlimit": limits.memlimit,
                 "salt": salt.hex()},
            nonce=nonce.hex(), ciphertext=ciphertext.hex())
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _derive_key(passphrase: bytes, salt: bytes, limits: KdfLimits) -> bytes:
    return argon2id.kdf(nacl.secret.SecretBox.KEY_SIZE, passphrase, salt,
                        opslimit=limits.opslimit, memlimit=limits.memlimit)


def create_keystore(path, identity: SigningIdentity, passphrase_source: PassphraseSource | None,
                    *, overwrite: bool = False, limits: KdfLimits | None = None) -> None:
    """Write ``identity`` to a new keystore; ``passphrase_source=None`` means unencrypted."""
    passphrase = None if passphrase_source is None else passphrase_source.read(str(path), confirm=True)
    write_file_atomic(path, encode_keystore(identity, passphrase, limits), mode=0o600, overwrite=overwrite)


def _read_document(path) -> dict:
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise KeystoreError("keystore %s does not exist (create one with `meshnode keys new --out %s`)"
                            % (path, path)) from None
    except OSError as exc:
        raise KeystoreError("cannot open keystore %s: %s" % (path, exc.strerror)) from None
    with os.fdopen(fd, "rb") as fh:
        mode = stat.S_IMODE(os.fstat(fh.fileno()).st_mode)
        if mode & 0o077:
            raise KeystoreError("keystore %s is readable by group or others (mode %04o); run: chmod 600 %s"
                                % (path, mode, path))
        data = fh.read(MAX_KEYSTORE_BYTES + 1)
    if len(data) > MAX_KEYSTORE_BYTES:
        raise KeystoreError("%s is not a meshnode keystore: larger than %d bytes" % (path, MAX_KEYSTORE_BYTES))
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise KeystoreError("%s is not a meshnode keystore: not valid JSON (truncated or corrupted?)" % path) from None
    if not isinstance(document, dict) or document.get("format") != KEYSTORE_FORMAT:
        raise KeystoreError("%s is not a meshnode keystore: no \"format\": \"%s\"" % (path, KEYSTORE_FORMAT))
    if document.get("version") != KEYSTORE_VERSION:
        raise KeystoreError("keystore %s has version %r; this meshnode reads version %d"
                            % (path, document.get("version"), KEYSTORE_VERSION))
    return document


def _hex_field(document: dict, name: str, length: int | None, path) -> bytes:
    value = document.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or (length is not None and len(raw) != length):
        expected = "%d bytes of hex" % length if length is not None else "hex"
        raise KeystoreError("keystore %s is corrupted: field %s is not %s" % (path, name, expected))
    return raw


def read_public_key(path) -> bytes:
    """The public key stored in clear in a keystore: no passphrase needed."""
    return _hex_field(_read_document(path), "public_key", PUBLIC_KEY_BYTES, path)


def is_encrypted(path) -> bool:
    return _read_document(path).get("encryption") != "none"


def load_identity(path, passphrase_source: PassphraseSource | None) -> SigningIdentity:
    """Open a keystore. Raises KeystoreError with one clear line on any failure.

    An unencrypted keystore needs no passphrase and prints a warning to stderr on
    every load, so it cannot go unnoticed in production.
    """
    document = _read_document(path)
    public_key = _hex_field(document, "public_key", PUBLIC_KEY_BYTES, path)
    encryption = document.get("encryption")
    if encryption == "none":
        print(INSECURE_WARNING % path, file=sys.stderr)
        seed = _hex_field(document, "seed", SEED_BYTES, path)
    elif encryption == "xsalsa20poly1305":
        seed = _decrypt_seed(document, path, passphrase_source)
    else:
        raise KeystoreError("keystore %s uses unknown encryption %r" % (path, encryption))
    identity = SigningIdentity(seed)
    if identity.public_key != public_key:
        raise KeystoreError("keystore %s is corrupted: its public key does not match its secret key" % path)
    return identity


def _decrypt_seed(document: dict, path, passphrase_source: PassphraseSource | None) -> bytes:
    kdf = document.get("kdf")
    if not isinstance(kdf, dict) or kdf.get("name") != "argon2id":
        raise KeystoreError("keystore %s is corrupted: kdf must be argon2id" % path)
    opslimit, memlimit = kdf.get("opslimit"), kdf.get("memlimit")
    if (not isinstance(opslimit, int) or not isinstance(memlimit, int)
            or not argon2id.OPSLIMIT_MIN <= opslimit <= MAX_OPSLIMIT
            or not argon2id.MEMLIMIT_MIN <= memlimit <= MAX_MEMLIMIT):
        raise KeystoreError("keystore %s is corrupted: kdf limits out of range" % path)
    salt = _hex_field(kdf, "salt", argon2id.SALTBYTES, path)
    nonce = _hex_field(document, "nonce", nacl.secret.SecretBox.NONCE_SIZE, path)
    ciphertext = _hex_field(document, "ciphertext", SEED_BYTES + nacl.secret.SecretBox.MACBYTES, path)
    if passphrase_source is None:
        raise KeystoreError("keystore %s is encrypted and no passphrase source was given" % path)
    passphrase = passphrase_source.read(str(path))
    box = nacl.secret.SecretBox(_derive_key(passphrase, salt, KdfLimits(opslimit, memlimit)))
    try:
        return box.decrypt(ciphertext, nonce)
    except nacl.exceptions.CryptoError:
        raise KeystoreError("wrong passphrase for keystore %s (or the file was altered)" % path) from None
