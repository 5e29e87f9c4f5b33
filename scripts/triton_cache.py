"""Triton's compile cache, made to travel between GPU machines (scripts/gpu_suite.sh calls it).

    python3 scripts/triton_cache.py relocate CACHE_DIR       # after unpacking a cache made elsewhere
    python3 scripts/triton_cache.py pack CACHE_DIR FILE.tar.gz

Triton (3.x) keeps each compiled kernel in CACHE_DIR/<hash>/ and lists its files in a group file
``__grp__<name>.json`` by absolute path; a file the list names that does not exist is skipped, and a
kernel whose metadata (``<name>.json``) and binary are found loads without compiling. So a cache
unpacked under another path needs its group files pointed at the new folder (``relocate``), and a
packed cache keeps only what a load reads: group files, metadata, the binaries (``.cubin``) and the
compiled launchers (``.so``); the intermediate IR (ttir, ttgir, llir, ptx, source), most of the bytes, stays
behind.
"""
import json
import sys
import tarfile
from pathlib import Path

LOADED = (".json", ".cubin", ".so")     # what a cache hit reads; __grp__ files are .json too


def relocate(cache: Path) -> int:
    """Point every group file's paths into `cache`; returns how many changed."""
    changed = 0
    for group in cache.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        paths = data.get("child_paths") or {}
        moved = {name: str(cache / Path(path).parent.name / Path(path).name) for name, path in paths.items()}
        if moved != paths:
            group.write_text(json.dumps({**data, "child_paths": moved}))
            changed += 1
    return changed


def pack(cache: Path, archive: Path) -> int:
    """Write the files of `cache` a later load reads into the gzipped tar `archive`; returns its bytes."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(cache.glob("*/*")):
            if path.is_file() and path.suffix in LOADED:
                tar.add(path, arcname=path.relative_to(cache).as_posix())
    return archive.stat().st_size


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "relocate":
        cache = Path(argv[1]).resolve()
        print(f"triton cache {cache}: {relocate(cache) if cache.is_dir() else 0} kernels relocated")
    elif len(argv) == 3 and argv[0] == "pack":
        cache = Path(argv[1]).resolve()
        size = pack(cache, Path(argv[2])) if cache.is_dir() else 0
        print(f"triton cache {cache} packed into {argv[2]}: {size / 2**20:.1f} MiB")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
