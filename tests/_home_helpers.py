"""A subprocess environment like a user's own shell, with HOME in a temporary folder: what a dependency
writes under a user's home shows up there.  onnxruntime's telemetry writes a device id under the home folder
on import unless ORT_DISABLE_TELEMETRY or a CI variable is set (both checked by its library), so CI would hide
it: those are removed, and so are the variables that move caches out of the home folder."""
from __future__ import annotations

import os
from pathlib import Path

# The CI variables onnxruntime 1.32's libonnxruntime.so reads to leave telemetry off (its strings list them).
CI_VARIABLES = ("CI", "TF_BUILD", "GITHUB_ACTIONS", "GITLAB_CI", "CIRCLECI", "TRAVIS", "JENKINS_URL",
                "CODEBUILD_BUILD_ID", "BUILDKITE", "TEAMCITY_VERSION", "APPVEYOR", "BITBUCKET_BUILD_NUMBER")
MOVED_CACHES = ("MTEB_CACHE", "HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME", "HF_HUB_CACHE", "MPLCONFIGDIR",
                "WANDB_CACHE_DIR")


def user_env(home: Path, **extra: str) -> dict[str, str]:
    drop = {"ORT_DISABLE_TELEMETRY", "ORT_RUNNING_UNIT_TESTS", *CI_VARIABLES, *MOVED_CACHES}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HOME=str(home), **extra)
    return env
