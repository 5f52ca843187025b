"""The obstore reader (`worker.adapters.aws.obstore_reads`) beyond the readers' shared
contract (`test_adapters`): `--input-client` picks it, it signs with the credentials
boto3 finds and follows boto3's refreshes, and what obstore cannot read as boto3 would
(some keys, a bucket in another region) is read through boto3, said in a log line."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from botocore.credentials import RefreshableCredentials
from structlog.testing import capture_logs

from tests.support.aws import Aws
from tests.support.buckets import bucket_with
from tests.support.fakeaws import FakeImds, serve_http
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.recordingproxy import RecordingProxy
from worker.adapters.aws.obstore_reads import (
    ObstoreReader,
    _Credentials,
    open_obstore_reader,
)
from worker.adapters.aws.platform import PlatformUnavailable
from worker.adapters.aws.s3 import InputClient, S3BlobStore, open_s3_reader, s3_client
from worker.cli import build_parser, settings_from_flags
from worker.demo import LOCAL_AWS_ENV
from worker.errors import TransientError
from worker.ports import S3Location


@pytest.fixture
def local_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """The moto server's credentials and region in the environment."""
    for name, value in LOCAL_AWS_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    ("flags", "environment", "chosen"),
    [
        ([], {}, "obstore"),  # auto, and obstore imports
        (["--input-client", "boto3"], {}, "boto3"),
        ([], {"WORKER_INPUT_CLIENT": "boto3"}, "boto3"),
        (["--input-client", "obstore"], {"WORKER_INPUT_CLIENT": "boto3"}, "obstore"),
    ],
)
def test_input_client_picks_the_reader_the_preprocessing_processes_open(
    monkeypatch: pytest.MonkeyPatch,
    local_aws: None,
    flags: list[str],
    environment: dict[str, str],
    chosen: str,
) -> None:
    """`--input-client` (or WORKER_INPUT_CLIENT) decides which reader the store's
    `remote_reader` opens in another process, and the daemon's log says which."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    settings = settings_from_flags(build_parser().parse_args(["run", "--queue-url", "q", *flags]))
    store = S3BlobStore.from_environment(2, 2, settings.input_client)
    with capture_logs() as logs:
        reader = store.remote_reader()
    assert reader is not None
    opener = reader.open.func  # type: ignore[attr-defined]
    assert opener is {"obstore": open_obstore_reader, "boto3": open_s3_reader}[chosen]
    assert [e["client"] for e in logs if e["event"] == "inputs_read_with"] == [chosen]


@pytest.mark.parametrize("input_client", ["auto", "obstore"])
def test_without_obstore_auto_reads_with_boto3_and_obstore_cannot_start(
    monkeypatch: pytest.MonkeyPatch, local_aws: None, input_client: InputClient
) -> None:
    """Where obstore does not import, auto reads with boto3 and says why in a warning;
    asking for obstore is `PlatformUnavailable` (the daemon cannot start)."""
    monkeypatch.setitem(sys.modules, "obstore", None)  # `import obstore` raises
    monkeypatch.delitem(sys.modules, "worker.adapters.aws.obstore_reads")
    store = S3BlobStore.from_environment(2, 2, input_client)
    if input_client == "obstore":
        with pytest.raises(PlatformUnavailable, match="input_client=obstore"):
            store.remote_reader()
        return
    with capture_logs() as logs:
        reader = store.remote_reader()
    assert reader is not None and reader.open.func is open_s3_reader  # type: ignore[attr-defined]
    [said] = [e for e in logs if e["event"] == "inputs_read_with"]
    assert (said["client"], said["log_level"]) == ("boto3", "warning")
    assert "obstore does not import" in said["why"]


def test_keys_obstore_cannot_hold_as_they_are_are_read_through_boto3(
    aws: Aws, monkeypatch: pytest.MonkeyPatch, local_aws: None
) -> None:
    """obstore would read "/lead" as "lead" and "trail/" as "trail" (other objects) and
    refuses "a//b", "." and ".." segments and control characters: each such key is read
    through boto3, as its own object, with one warning; other keys through obstore."""
    odd = ["/lead", "trail/", "a//b", "a/./b", "a/../b", "tab\tkey"]
    near = {"lead": b"not /lead", "trail": b"not trail/", "a/b": b"not a//b", "plain": b"plain"}
    bucket = bucket_with(aws, {**{key: key.encode() for key in odd}, **near})
    proxy = RecordingProxy(aws.endpoint)
    with proxy.serving() as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        get = open_obstore_reader(2, 4)
        with capture_logs() as logs:
            assert [get(S3Location(bucket, key)) for key in odd] == [k.encode() for k in odd]
            assert get(S3Location(bucket, "plain")) == b"plain"
    by_boto3 = [sent.by_boto3 for sent in proxy.sent(under=f"/{bucket}/")]
    assert by_boto3 == [True] * len(odd) + [False]
    [told] = [e for e in logs if e["event"] == "input_reads_through_boto3"]
    assert told["location"] == f"s3://{bucket}//lead"


def test_a_bucket_in_another_region_is_read_through_boto3_from_then_on(
    aws: Aws, monkeypatch: pytest.MonkeyPatch, local_aws: None
) -> None:
    """S3's answer to a request sent to the wrong region (301 PermanentRedirect, which
    obstore does not follow and boto3 does) makes that bucket's reads go through boto3,
    the first one included, with a warning naming the bucket; other buckets stay with
    obstore."""
    there = bucket_with(aws, {"in/a": b"a", "in/b": b"b"})
    here = bucket_with(aws, {"in/c": b"c"})
    recording = RecordingProxy(aws.endpoint)
    with recording.serving() as upstream:
        faults = FaultProxy(upstream)
        to_there = lambda request: request.path == f"/{there}/in/a"  # noqa: E731
        faults.add(Fault("moved", to_there, times=1, status=301, code="PermanentRedirect"))
        with faults.serving() as endpoint:
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            get = open_obstore_reader(2, 4)
            with capture_logs() as logs:
                read = [get(S3Location(there, "in/a")), get(S3Location(there, "in/b"))]
                read.append(get(S3Location(here, "in/c")))
    assert read == [b"a", b"b", b"c"]
    assert faults.injected["moved"] == 1
    assert [sent.by_boto3 for sent in recording.sent(under=f"/{there}/")] == [True, True]
    assert [sent.by_boto3 for sent in recording.sent(under=f"/{here}/")] == [False]
    [told] = [e for e in logs if e["event"] == "input_reads_through_boto3"]
    assert told["bucket"] == there


def _role_credentials(access_key: str) -> str:
    """A role's credentials as instance metadata and the ECS agent give them."""
    expires = (datetime.now(UTC) + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
    fields = {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": access_key}
    fields |= {"SecretAccessKey": "secret", "Token": "token", "Expiration": expires}
    return json.dumps(fields)


@contextlib.contextmanager
def _credentials_from(source: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment in which boto3 finds credentials from `source` alone, and none
    of the keys obstore would read itself (a local stand-in serving them meanwhile)."""
    if source == "profile":
        credentials = tmp_path / "credentials"
        credentials.write_text(
            "[reader]\naws_access_key_id = AKIDprofile\naws_secret_access_key = s\n"
        )
        yield {"AWS_SHARED_CREDENTIALS_FILE": str(credentials), "AWS_PROFILE": "reader"}
    elif source == "instance":
        imds = FakeImds("i-1", "group")
        role = "/latest/meta-data/iam/security-credentials/"
        imds.paths |= {role: "worker-role", f"{role}worker-role": _role_credentials("AKIDinstance")}
        with imds.serving() as url:
            yield {"AWS_EC2_METADATA_DISABLED": "false", "AWS_EC2_METADATA_SERVICE_ENDPOINT": url}
    else:

        class Agent(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = _role_credentials("AKIDtask").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        with serve_http(Agent) as url:  # the ECS agent's, as a task role's FULL_URI names it
            yield {"AWS_CONTAINER_CREDENTIALS_FULL_URI": f"{url}/v2/credentials/task"}


@pytest.mark.parametrize("source", ["profile", "instance", "task"])
def test_requests_are_signed_with_the_credentials_boto3_finds(
    aws: Aws, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str
) -> None:
    """Credentials from a profile in boto3's shared credentials file (which obstore does
    not read itself), from an instance profile through IMDSv2, or from an ECS task
    role's endpoint, with no keys in the environment: obstore's requests are signed
    with the key boto3 found there."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = bucket_with(aws, {"in/a": b"a"})
    proxy = RecordingProxy(aws.endpoint)
    with _credentials_from(source, tmp_path) as environment, proxy.serving() as endpoint:
        for name, value in {**environment, "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(name, value)
        assert open_obstore_reader(2, 4)(S3Location(bucket, "in/a")) == b"a"
    [sent] = proxy.sent(under=f"/{bucket}/")
    assert (sent.by_boto3, sent.access_key) == (False, f"AKID{source}")


def test_credentials_are_read_from_boto3_as_it_refreshes_them() -> None:
    """A role's credentials, which boto3 refreshes before they expire, are given to
    obstore as boto3 holds them now, each said to last 10 minutes (obstore asks again
    5 minutes before that)."""
    keys = iter(["first", "second"])

    def refresh() -> dict[str, str]:
        soon = datetime.now(UTC) + timedelta(minutes=1)  # within boto3's refresh margin
        return {
            "access_key": next(keys),
            "secret_key": "secret",
            "token": "token",
            "expiry_time": soon.isoformat(),
        }

    provider = _Credentials(RefreshableCredentials.create_from_metadata(refresh(), refresh, "t"))
    given = provider()
    assert (given["access_key_id"], given.get("token")) == ("second", "token")
    assert given["expires_at"] is not None
    lasts = given["expires_at"] - datetime.now(UTC)
    assert timedelta(minutes=9) < lasts <= timedelta(minutes=10)


def test_credentials_that_cannot_be_had_are_transient(aws: Aws, local_aws: None) -> None:
    """A read whose credentials cannot be had (boto3's refresh failed) is
    `TransientError` once its tries are spent, as boto3's `NoCredentialsError` is."""

    def failing() -> dict[str, str]:
        raise RuntimeError("the instance metadata service did not answer")

    reader = ObstoreReader(
        aws.endpoint,
        "us-east-1",
        failing,  # type: ignore[arg-type]
        attempts=2,
        connections=2,
        through_boto3=S3BlobStore(s3_client(2)),
    )
    with pytest.raises(TransientError, match="credentials"):
        reader.get(S3Location(bucket_with(aws, {"in/a": b"a"}), "in/a"))
