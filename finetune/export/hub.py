"""`finetune export … --push-to-hub REPO_ID`: upload an export folder with huggingface_hub.

`check_can_push` runs before the export writes anything, so an offline machine, a bad repo id or a
missing login fails at once; `push` then uploads the finished folder, which stays as it is whatever
happens to the upload.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

from finetune.errors import HubError



def check_can_push(repo_id: str, timeout: float = 5.0) -> None:
    """Raise HubError unless `repo_id` is a valid repo id, the Hub is reachable and a token is set."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"--push-to-hub {repo_id!r}: {e} Use the form user/model-name.") from e
    if constants.is_offline_mode():
        raise HubError(f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set, so nothing can be uploaded. Unset it "
                       "(or drop --push-to-hub, export locally, and upload the folder later with `hf upload`).")
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
    except OSError as e:
        raise HubError(f"--push-to-hub {repo_id}: cannot reach {constants.ENDPOINT} ({e}). Check the network "
                       "(or drop --push-to-hub, export locally, and upload the folder later with `hf upload`).") from e
    if get_token() is None:
        raise HubError(f"--push-to-hub {repo_id}: not logged in to the Hugging Face Hub; run `hf auth login` "
                       "or set HF_TOKEN.")


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
