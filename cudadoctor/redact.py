"""Redaction for facts snapshots that leave the machine (``cudadoctor collect``).

User names, home directories and host names in every string are replaced by placeholders
("/home/<user>", "<host>"); structure, keys, numbers, booleans and version strings stay intact.
``/root`` is not a personal name and stays as it is.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from typing import Any, Iterable

USER = "<user>"
HOST = "<host>"

_HOME_RE = re.compile(r"(?P<prefix>/home/|/Users/|/usr/home/|[A-Za-z]:\\Users\\|[A-Za-z]:/Users/)(?P<name>[^/\\\s:;,'\"]+)")
_GENERIC_USERS = {"root", "user", "<user>", "shared", "public", "runner", "default", "all users", "default user"}
_SHORT = 2  # names this short would match too much to replace as bare words


def _current_identities() -> tuple[set[str], set[str]]:
    users: set[str] = set()
    hosts: set[str] = set()
    for fn in (getpass.getuser, lambda: os.environ.get("USER"), lambda: os.environ.get("LOGNAME"),
               lambda: os.environ.get("SUDO_USER")):
        try:
            v = fn()
        except Exception:  # noqa: BLE001 - getuser raises when no name can be found
            v = None
        if v:
            users.add(v)
    home = os.path.expanduser("~")
    if home and home not in ("/", "/root") and os.path.basename(home):
        users.add(os.path.basename(home))
    for fn in (socket.gethostname, lambda: socket.getfqdn(), lambda: os.uname().nodename):
        try:
            v = fn()
        except Exception:  # noqa: BLE001
            v = None
        if v and v not in ("localhost", "localhost.localdomain"):
            hosts.add(v)
            hosts.add(v.split(".")[0])
    users = {u for u in users if u.lower() not in _GENERIC_USERS and len(u) > _SHORT}
    hosts = {h for h in hosts if len(h) > 1 and not h.isdigit()}
    return users, hosts


def _names_in(obj: Any, found: set[str]) -> None:
    if isinstance(obj, str):
        for m in _HOME_RE.finditer(obj):
            name = m.group("name")
            if name.lower() not in _GENERIC_USERS and not name.startswith("<"):
                found.add(name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _names_in(k, found)
            _names_in(v, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _names_in(v, found)


def _word_re(names: Iterable[str]) -> re.Pattern | None:
    names = sorted({n for n in names if n}, key=len, reverse=True)
    if not names:
        return None
    alt = "|".join(re.escape(n) for n in names)
    # a name as a whole word: not glued to letters/digits, so "ann" does not hit "channel"
    return re.compile(rf"(?<![A-Za-z0-9])(?:{alt})(?![A-Za-z0-9])")


def redact(facts: dict, *, users: Iterable[str] = (), hosts: Iterable[str] = ()) -> dict:
    """A copy of ``facts`` with user names, home paths and host names replaced. Never raises.

    Names come from the running process (login name, home directory, host name) and from the home
    paths found in the snapshot itself; ``users``/``hosts`` add more.
    """
    cur_users, cur_hosts = _current_identities()
    user_set = set(users) | cur_users
    found: set[str] = set()
    _names_in(facts, found)
    user_set |= found
    user_set = {u for u in user_set if u and u.lower() not in _GENERIC_USERS}
    host_set = {h for h in (set(hosts) | cur_hosts) if h} - user_set
    user_word = _word_re(u for u in user_set if len(u) > _SHORT)
    host_word = _word_re(host_set)

    def fix(s: str) -> str:
        def home(m: re.Match) -> str:
            name = m.group("name")
            if name.lower() in _GENERIC_USERS or name.startswith("<"):
                return m.group(0)
            return m.group("prefix") + USER

        out = _HOME_RE.sub(home, s)
        if host_word is not None:
            out = host_word.sub(HOST, out)
        if user_word is not None:
            out = user_word.sub(USER, out)
        return out

    def walk(obj: Any) -> Any:
        if isinstance(obj, str):
            return fix(obj)
        if isinstance(obj, dict):
            return {(fix(k) if isinstance(k, str) else k): walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return [walk(v) for v in obj]
        return obj

    try:
        return walk(facts)
    except RecursionError:
        return {"schema": facts.get("schema") if isinstance(facts, dict) else None,
                "error": "snapshot too deeply nested to redact"}
