"""Functions `test_host_call` runs inside a sandbox (copied there alone: standard library only)."""

import urllib.request


def fetch_twice(url, size):
    """Two requests over the relay, `size` bytes each way; what came back, as lengths and a checksum."""
    got = []
    for _ in range(2):
        with urllib.request.urlopen(urllib.request.Request(url + "/echo", data=b"x" * size), timeout=30) as r:
            got.append(r.read())
    print("noise on stdout")
    return {"lengths": [len(g) for g in got], "same": all(g == b"x" * size for g in got)}


def raises(url):
    raise KeyError("no such thing in " + url)


def exits(url):
    import os

    os._exit(7)


def sleeps(url):
    import time

    time.sleep(60)
