"""What the image holds besides the code: the codec's compiled kernels, built with it.

Each container would otherwise compile them at its first encode (numba, seconds of CPU per
container start, ``common/quantize_cpu.py``). A real container of the built image, as the
image's own user, with no network."""

from __future__ import annotations

from docker_helpers import run

SCRIPT = (
    "from ddiloco.common import quantize_cpu as k\n"
    "k.ready()\n"
    "stats = [f.stats for f in (k.quantize, k.dequantize)]\n"
    "print(stats[0].cache_path, sum(sum(s.cache_hits.values()) for s in stats), "
    "sum(sum(s.cache_misses.values()) for s in stats))\n"
)


def test_a_container_loads_the_codecs_kernels_from_the_cache_built_into_the_image(engine):
    out = run("docker", "run", "--rm", "--network", "none", "--entrypoint", "/opt/venv/bin/python", engine,
              "-c", SCRIPT, timeout=300).stdout.split()
    path, hits, misses = out
    assert path.startswith("/opt/numba-cache/"), path  # the image's cache, which this user may write
    assert (int(hits), int(misses)) == (6, 0)  # every version loaded, none compiled
