"""A finished record's status, read from its JSON without parsing it whole
(gateway/server/results/reader.py's `record_state`, what a woken long-poll answers with),
pure logic."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.protocol import ResultRecord, State
from gateway.server.results.reader import record_state


def test_a_records_own_status_is_read_not_a_status_inside_its_strings_or_outputs() -> None:
    record = ResultRecord(
        request_id="r1",
        model='tricky "status":"failed"',
        status=State.SUCCEEDED,
        created_at=datetime.now(UTC),
        outputs={"status": "failed", "vector": [0.5] * 512},
    )
    assert record_state(record.model_dump_json()) == State.SUCCEEDED
