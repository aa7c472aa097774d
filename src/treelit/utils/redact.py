"""Credentials out of everything a run writes, logs, prints or sends to MLflow.

A tracking URI often carries a secret: ``postgresql://alice:PASSWORD@db/mlflow``,
``https://TOKEN@mlflow.example``, ``...?password=...&token=...``; ``MLFLOW_TRACKING_URI``
puts it into the composed config, and from there it would reach ``config.yaml``, the
MLflow params, ``summary.json``, the printed summary, ``train.log`` and the checkpoints.
Every writer therefore passes text through :func:`redact_text` (configs through
:func:`redact_config`): the password of a URI's user info becomes ``***``
(``postgresql://alice:***@db/mlflow``), user info without a password is taken for a
token (``https://***@host``), and the value of a query parameter whose name looks like a
credential (containing ``pass``, ``pwd``, ``token``, ``secret``, ``key``, ``auth``,
``sig``, ``credential`` or ``session``, any case) becomes ``***``. Config values under a
key that names a credential (``password``, ``api_key``, ...) are replaced whole. The
store itself is opened with the real URI; only what is recorded is redacted.

The same rules are applied to every log record by :class:`RedactFilter` (installed on
the console and ``train.log`` handlers by ``treelit-train``'s logging config).
"""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["MASK", "redact_text", "redact_config", "RedactFilter"]

MASK = "***"

# scheme://user:password@  or  scheme://token@  (user info ends at the last '@' of the word: SQLAlchemy
# takes '/', '?' and '#' unescaped in a password, as in postgresql://alice:a/b?c@db/mlflow)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/?#@:'\"]*)(?::(?P<pw>[^\s'\"]*))?@")
_SECRET_NAME = r"[A-Za-z0-9_.\-]*(?:pass|pwd|token|secret|key|auth|sig|credential|session)[A-Za-z0-9_.\-]*"
# ?name=value / &name=value / ;name=value inside a URI
_QUERY = re.compile(r"(?P<lead>[?&;](?i:" + _SECRET_NAME + r")=)(?P<value>[^&#\s'\"]*)")
# config keys whose whole value is a credential (also as ``key=value`` / ``a.b.key=value`` in text)
_SECRET_KEY = (r"(?:password|passwd|pwd|secret|token|api[_\-]?key|access_?key|secret_?key|private_?key|client_?secret|"
               r"access_?token|auth_?token|hf_?token|credentials?|(?:proxy[_\-]?)?authorization|\w*_password|\w*_secret|"
               r"[\w\-]*[_\-]api[_\-]?key|\w*_access_?key)")
_SECRET_KEYS = re.compile(r"(?i)^" + _SECRET_KEY + r"$")
# the value: quoted, or one word (two for an HTTP header's "Bearer TOKEN")
_ASSIGN = re.compile(r"(?P<lead>(?<![\w.?&;])(?:[\w\-]+\.)*(?i:" + _SECRET_KEY + r")=)"
                     r"(?P<value>\"[^\"\n]*\"|'[^'\n]*'|(?:(?i:bearer|basic|token|digest)[ \t]+)?[^\s,;'\"]+)")


def _userinfo(m: "re.Match[str]") -> str:
    if m.group("pw") is not None:
        return f"{m.group('scheme')}{m.group('user')}:{MASK}@"
    return f"{m.group('scheme')}{MASK}@" if m.group("user") else m.group(0)


def redact_text(text: str) -> str:
    """``text`` with URI credentials replaced by ``***`` (see the module docstring)."""
    if not isinstance(text, str) or ("@" not in text and "=" not in text):
        return text
    text = _USERINFO.sub(_userinfo, text)
    text = _QUERY.sub(lambda m: m.group("lead") + (MASK if m.group("value") else ""), text)
    return _ASSIGN.sub(lambda m: m.group("lead") + MASK, text)


def redact_config(node: Any, key: str = "") -> Any:
    """A copy of a plain config (dicts, lists, scalars; e.g. ``OmegaConf.to_container``)
    with every string passed through :func:`redact_text` and the values of credential
    keys replaced by ``***``."""
    if isinstance(node, dict):
        return {k: redact_config(v, str(k)) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(redact_config(v, key) for v in node)
    if key and node not in (None, "") and _SECRET_KEYS.match(key.rsplit(".", 1)[-1]):
        return MASK
    return redact_text(node) if isinstance(node, str) else node


class RedactFilter(logging.Filter):
    """A logging filter that redacts each record's message (arguments merged) and its
    traceback text before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # pragma: no cover - a broken record: let the handler report it
            return True
        clean = redact_text(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True
