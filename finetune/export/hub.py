"""`finetune export … --push-to-hub REPO_ID`: upload an export folder with huggingface_hub.

`check_can_push` runs before the export writes anything, so an offline machine, a bad repo id or a
missing login fails at once; `push` then uploads the finished folder, which stays as it is whatever
happens to the upload.
"""

from __future__ import annotations

from pathlib import Path

from finetune.errors import HubError

LATER = "or drop --push-to-hub, export locally, and upload the folder later with `hf upload`"


def check_can_push(repo_id: str) -> None:
    """Raise HubError unless `repo_id` is a valid repo id and the Hub accepts this machine's token:
    `HfApi.whoami` reaches the Hub with the token, so a revoked token fails here, before the
    export is written, rather than at the upload after it."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"--push-to-hub {repo_id!r}: {e} Use the form user/model-name.") from e
    if constants.is_offline_mode():
        raise HubError(f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set, so nothing can be uploaded. Unset it "
                       f"({LATER}).")
    try:
        HfApi().whoami()
    except LocalTokenNotFoundError as e:
        raise HubError(f"--push-to-hub {repo_id}: not logged in to the Hugging Face Hub; run `hf auth login` "
                       "or set HF_TOKEN.") from e
    except HfHubHTTPError as e:
        raise HubError(f"--push-to-hub {repo_id}: the Hub refused this machine's token ({str(e).splitlines()[0]}) "
                       "Run `hf auth login --force` with a valid token, or set HF_TOKEN to one.") from e
    except (_http_library_error(), OSError) as e:
        raise HubError(f"--push-to-hub {repo_id}: cannot reach {constants.ENDPOINT} ({e}). Check the network "
                       f"({LATER}).") from e


def _http_library_error() -> type[Exception]:
    """The base error of the HTTP library huggingface_hub talks through (connection refused, DNS,
    timeouts): httpx, or httpx2 in newer huggingface_hub releases."""
    try:
        import httpx2 as http
    except ImportError:
        import httpx as http
    return http.HTTPError


def push(folder: Path, repo_id: str, private: bool = False) -> str:
    """Create `repo_id` if needed and upload `folder` as one commit; returns the repo's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload model exported by finetune")
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"Uploading {folder} to {repo_id} failed: {e}. The export in {folder} is complete; upload it "
                       f"again with `hf upload {repo_id} {folder}`.") from e
    return str(url)
