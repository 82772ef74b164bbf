"""`--device remote:URL[,name=NAME][,api_key=ENV_VAR][,read_timeout=S][,ca=PATH]`.

The API key is read from the environment variable named by api_key=, when the worker
connects, and is only ever sent as the Authorization header: the config, the device string,
log lines, snapshots, traces and error messages name the variable, never its value (every
text a remote worker reports passes through `Secret.redact` too, in case a server echoes it).
"""
from __future__ import annotations

import os
import ssl
from dataclasses import replace

import httpx

from engine.config import RemoteOptions, WorkerConfig
from engine.errors import ConfigError

FIELDS = "name=NAME, api_key=ENV_VAR, read_timeout=SECONDS, ca=PATH"


def parse_remote(spec: str, base: WorkerConfig, earlier: list[WorkerConfig]) -> WorkerConfig:
    """remote:URL[,field=value...] -> a WorkerConfig whose device is remote:URL."""
    count = sum(w.remote for w in earlier)
    body = spec[len("remote:"):]
    url, *fields = body.split(",")
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"`device={spec}`: write remote:http://HOST:PORT[,name=NAME] (or https://), "
                          "e.g. `device=remote:http://127.0.0.1:8001`")
    name = f"remote{count or ''}"
    opts = RemoteOptions()
    for item in fields:
        key, _, value = item.partition("=")
        if not value:
            raise ConfigError(f"`device={spec}`: {item!r} needs a value; the fields are {FIELDS}")
        if key == "name":
            name = value
        elif key == "api_key":
            if not value.replace("_", "").isalnum() or value[0].isdigit():
                raise ConfigError(f"`device={spec}`: api_key= names an environment variable (e.g. "
                                  "api_key=VLLM_API_KEY), not the key itself")
            if value not in os.environ:
                raise ConfigError(f"`device={spec}`: api_key={value}, but the environment has no {value}; "
                                  f"export {value}=<the server's key> first")
            opts = replace(opts, api_key_env=value)
        elif key == "read_timeout":
            try:
                seconds = float(value)
            except ValueError:
                seconds = 0.0
            if not seconds > 0:
                raise ConfigError(f"`device={spec}`: read_timeout must be a positive number of seconds, "
                                  f"got {value!r}")
            opts = replace(opts, read_timeout=seconds)
        elif key == "ca":
            if not os.path.isfile(value):
                raise ConfigError(f"`device={spec}`: ca={value}: no such file (a PEM bundle of the CA "
                                  "that signed the server's certificate)")
            opts = replace(opts, ca_file=value)
        else:
            raise ConfigError(f"`device={spec}`: unknown field {item!r}; the fields are {FIELDS}")
    if opts.ca_file and not url.startswith("https://"):
        raise ConfigError(f"`device={spec}`: ca= is for https:// servers")
    return replace(base, device=f"remote:{url}", name=name, calibrate=False, remote_options=opts)


def remote_url(cfg: WorkerConfig) -> str:
    return cfg.device[len("remote:"):]


class Secret:
    """The remote's API key, from the environment, and what every client needs to use it."""

    def __init__(self, opts: RemoteOptions):
        self.value = os.environ.get(opts.api_key_env, "") if opts.api_key_env else ""
        self.env = opts.api_key_env
        self.verify = ssl.create_default_context(cafile=opts.ca_file) if opts.ca_file else True

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.value}"} if self.value else {}

    def client_kwargs(self) -> dict:
        return {"headers": self.headers(), "verify": self.verify}

    def redact(self, text: str) -> str:
        return text.replace(self.value, f"${self.env}") if self.value else text

    def refused(self, url: str, status: int) -> str:
        """What to say when the server refuses our key (or wants one)."""
        if self.env:
            return f"{url} refused the API key ({status}): check the key in ${self.env}"
        return f"{url} wants an API key ({status}): add api_key=ENV_VAR to the `device` and export it"


def client_timeout(opts: RemoteOptions) -> httpx.Timeout:
    """Connecting and writing are quick or broken; reading waits at most read_timeout for data."""
    return httpx.Timeout(10.0, read=opts.read_timeout)
