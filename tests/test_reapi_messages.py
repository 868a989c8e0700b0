"""The REAPI execution and Remote Workers messages: round trips, and field numbers as published."""

from google.longrunning import operations_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from build_graph.store.reapi import reapi_pb2 as pb
from build_graph.store.reapi import remoteworkers_pb2 as rw

# Field numbers read in bazelbuild/remote-apis remote_execution.proto and googleapis'
# google/devtools/remoteworkers/v1test2/{bots,worker}.proto. A wrong number would still round-trip
# through our own messages but would be garbage to BuildGrid: this table is what catches it.
SPEC = {
    pb.Action: {"command_digest": 1, "input_root_digest": 2, "timeout": 6, "do_not_cache": 7,
                "salt": 9, "platform": 10},
    pb.Command: {"arguments": 1, "environment_variables": 2, "output_files": 3,
                 "output_directories": 4, "platform": 5, "working_directory": 6, "output_paths": 7,
                 "output_node_properties": 8, "output_directory_format": 9},
    pb.Directory: {"files": 1, "directories": 2, "symlinks": 3, "node_properties": 5},
    pb.FileNode: {"name": 1, "digest": 2, "is_executable": 4, "node_properties": 6},
    pb.SymlinkNode: {"name": 1, "target": 2, "node_properties": 4},
    pb.OutputDirectory: {"path": 1, "tree_digest": 3, "is_topologically_sorted": 4,
                         "root_directory_digest": 5},
    pb.ActionResult: {"output_files": 2, "output_directories": 3, "exit_code": 4, "stdout_raw": 5,
                      "stdout_digest": 6, "stderr_raw": 7, "stderr_digest": 8,
                      "execution_metadata": 9, "output_file_symlinks": 10,
                      "output_directory_symlinks": 11, "output_symlinks": 12},
    pb.ExecutedActionMetadata: {"worker": 1, "queued_timestamp": 2, "worker_start_timestamp": 3,
                                "execution_start_timestamp": 7, "output_upload_completed_timestamp": 10,
                                "auxiliary_metadata": 11, "virtual_execution_duration": 12},
    pb.ExecuteRequest: {"instance_name": 1, "skip_cache_lookup": 3, "action_digest": 6,
                        "execution_policy": 7, "results_cache_policy": 8, "digest_function": 9,
                        "inline_stdout": 10},
    pb.ExecuteResponse: {"result": 1, "cached_result": 2, "status": 3, "server_logs": 4, "message": 5},
    pb.ExecuteOperationMetadata: {"stage": 1, "action_digest": 2, "stdout_stream_name": 3,
                                  "partial_execution_metadata": 5, "digest_function": 6},
    pb.WaitExecutionRequest: {"name": 1},
    rw.BotSession: {"name": 1, "bot_id": 2, "status": 3, "worker": 4, "leases": 5, "expire_time": 6,
                    "version": 7},
    rw.Lease: {"assignment": 1, "state": 2, "status": 3, "requirements": 4, "expire_time": 5,
               "inline_assignment": 6, "id": 7, "payload": 8, "result": 9},
    rw.CreateBotSessionRequest: {"parent": 1, "bot_session": 2},
    rw.UpdateBotSessionRequest: {"name": 1, "bot_session": 2, "update_mask": 3},
    rw.Worker: {"devices": 1, "properties": 2, "configs": 3},
    rw.Device: {"handle": 1, "properties": 2},
}


def test_field_numbers_match_the_published_protos():
    """Every listed field exists with the spec's number."""
    for message, fields in SPEC.items():
        by_name = message.DESCRIPTOR.fields_by_name
        for name, number in fields.items():
            assert name in by_name, f"{message.DESCRIPTOR.full_name} lacks {name}"
            assert by_name[name].number == number, f"{message.DESCRIPTOR.full_name}.{name}"


def test_enum_values_match_the_published_protos():
    """Lease states, bot status and execution stages keep the spec's values."""
    assert (rw.PENDING, rw.ACTIVE, rw.COMPLETED, rw.CANCELLED) == (1, 2, 4, 5)
    assert rw.BotStatus.Value("OK") == 1
    assert pb.ExecutionStage.QUEUED == 2 and pb.ExecutionStage.EXECUTING == 3
    assert pb.ExecutionStage.COMPLETED == 4
    assert pb.DigestFunction.BLAKE3 == 9


def test_full_names_are_the_wire_names():
    """Any type URLs carry the full names BuildGrid expects."""
    assert pb.Action.DESCRIPTOR.full_name == "build.bazel.remote.execution.v2.Action"
    assert rw.BotSession.DESCRIPTOR.full_name == "google.devtools.remoteworkers.v1test2.BotSession"
    assert pb.ExecuteResponse.DESCRIPTOR.fields_by_name["status"].message_type.full_name == "google.rpc.Status"


def _digest(h: str, n: int) -> pb.Digest:
    return pb.Digest(hash=h * 64, size_bytes=n)


def test_action_command_tree_round_trip():
    """Action, Command and a Tree with every node kind survive serialization."""
    command = pb.Command(arguments=["/bin/sh", "-c", "echo hi > bgraph/out/x"],
                         output_paths=["bgraph/out/x"], working_directory="")
    command.environment_variables.add(name="PATH", value="/usr/bin")
    command.platform.properties.add(name="OSFamily", value="Linux")
    action = pb.Action(command_digest=_digest("a", 10), input_root_digest=_digest("b", 20),
                       do_not_cache=False)
    action.timeout.seconds = 30
    action.platform.properties.add(name="ISA", value="x86-64")
    root = pb.Directory()
    root.files.add(name="f", digest=_digest("c", 3), is_executable=True)
    root.directories.add(name="d", digest=_digest("d", 4))
    root.symlinks.add(name="bin", target="usr/bin")
    tree = pb.Tree(root=root, children=[pb.Directory()])
    for message in (command, action, tree):
        again = type(message).FromString(message.SerializeToString())
        assert again == message
    assert pb.Action.FromString(action.SerializeToString()).timeout.seconds == 30


def test_execute_response_with_missing_precondition_round_trips():
    """An ExecuteResponse holding FAILED_PRECONDITION + MISSING packs and unpacks through an Operation."""
    failure = error_details_pb2.PreconditionFailure()
    failure.violations.add(type="MISSING", subject="blobs/" + "e" * 64 + "/5")
    status = status_pb2.Status(code=code_pb2.FAILED_PRECONDITION, message="missing input")
    status.details.add().Pack(failure)
    response = pb.ExecuteResponse(status=status)
    response.result.exit_code = 3
    response.result.execution_metadata.worker = "host/0"
    response.result.output_directories.add(path="bgraph/out", tree_digest=_digest("f", 9))
    op = operations_pb2.Operation(name="op", done=True)
    op.response.Pack(response)
    op.metadata.Pack(pb.ExecuteOperationMetadata(stage=pb.ExecutionStage.COMPLETED))
    wire = operations_pb2.Operation.FromString(op.SerializeToString())
    back = pb.ExecuteResponse()
    assert wire.response.Unpack(back)
    assert back.result.exit_code == 3 and back.result.output_directories[0].path == "bgraph/out"
    got = error_details_pb2.PreconditionFailure()
    assert back.status.details[0].Unpack(got)
    assert got.violations[0].subject.startswith("blobs/")


def test_bot_session_with_lease_round_trips():
    """A BotSession with an ACTIVE lease carrying Any(Action) and a completed result."""
    session = rw.BotSession(bot_id="host/0", status=rw.OK)
    device = session.worker.devices.add(handle="host/0")
    device.properties.add(key="OSFamily", value="Linux")
    lease = session.leases.add(id="job-1", state=rw.ACTIVE)
    lease.payload.Pack(pb.Action(command_digest=_digest("a", 1)))
    lease.result.Pack(pb.ActionResult(exit_code=0))
    lease.status.code = code_pb2.OK
    back = rw.BotSession.FromString(session.SerializeToString())
    action = pb.Action()
    assert back.leases[0].payload.Unpack(action) and action.command_digest.size_bytes == 1
    assert back.leases[0].payload.Is(pb.Action.DESCRIPTOR)
    assert back == session


def test_old_cache_fields_keep_their_numbers():
    """The cache client's messages are unchanged by the execution fields (same wire)."""
    old = pb.ActionResult(exit_code=1, stdout_raw=b"x")
    old.output_files.add(path="o", digest=_digest("a", 1), is_executable=True)
    assert pb.ActionResult.FromString(old.SerializeToString()) == old
    assert pb.OutputFile.DESCRIPTOR.fields_by_name["contents"].number == 5
