"""What each S3 client costs before its first byte moves: the installed size of its distribution
and everything it requires (that this environment holds), and the wall time of a process that
imports it and makes a client (timed from outside, e.g. with /usr/bin/time, against
``python -c pass``).

    python docs/results/s3_client_costs.py size boto3 awscrt obstore minio s3fs
    python docs/results/s3_client_costs.py import CLIENT     # the command to time
"""

from __future__ import annotations

import json
import os
import re
import sys
from importlib import metadata

MAKE = {
    "boto3": "import boto3; boto3.client('s3')",
    "boto3-crt": "import boto3, awscrt.s3; boto3.client('s3')",
    "obstore": "import obstore.store; obstore.store.S3Store('b', region='us-east-1')",
    "minio": "import minio; minio.Minio('127.0.0.1:9000')",
    "s3fs": "import s3fs; s3fs.S3FileSystem()",
}


def closure(name: str, seen: set[str]) -> None:
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return
    seen.add(key)
    for req in dist.requires or ():
        if "extra ==" in req:
            continue
        closure(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0], seen)


def size(name: str) -> int:
    seen: set[str] = set()
    closure(name, seen)
    total = 0
    for dist_name in seen:
        dist = metadata.distribution(dist_name)
        for f in dist.files or ():
            path = f.locate()
            if os.path.isfile(path):
                total += os.path.getsize(path)
    return total


if __name__ == "__main__":
    if sys.argv[1] == "size":
        for name in sys.argv[2:]:
            seen: set[str] = set()
            closure(name, seen)
            print(json.dumps({"client": name, "mib": round(size(name) / 2**20, 1), "distributions": sorted(seen)}))
    else:
        exec(MAKE[sys.argv[2]])
