"""Enqueue from Python with psycopg 3: the business row and its event in one
transaction. Usage (what the polyglot test runs):

    DATABASE_URL=postgres://... python3 enqueue.py <aggregate-id>...

Same behaviour as enqueue.mjs: FIFOBOX_EVENTS committed transactions per
aggregate, then one rolled back, then an invalid event that must be refused
naming its field; one JSON line per committed event.
"""
import datetime
import json
import os
import sys

import psycopg

per_aggregate = int(os.environ.get("FIFOBOX_EVENTS", "20"))


def enqueue_order(conn, aggregate_id, n, commit=True):
    with conn.transaction(force_rollback=not commit):
        conn.execute(
            "INSERT INTO poly_business (producer, aggregate_id, n) VALUES ('python', %s, %s)",
            (aggregate_id, n),
        )
        row = conn.execute(
            """SELECT event_id, sequence FROM fifobox_enqueue(
                   aggregate_type => 'order', aggregate_id => %s, type => 'order.updated',
                   payload => %s, tenant_id => 'acme', occurred_at => %s)""",
            (aggregate_id, json.dumps({"producer": "python", "n": n}),
             datetime.datetime.now(datetime.timezone.utc)),
        ).fetchone()
    return row


with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
    for n in range(per_aggregate):
        for aggregate_id in sys.argv[1:]:
            event_id, sequence = enqueue_order(conn, aggregate_id, n)
            print(json.dumps({"event_id": str(event_id), "aggregate_id": aggregate_id, "sequence": sequence}), flush=True)
    for aggregate_id in sys.argv[1:]:
        enqueue_order(conn, aggregate_id, -1, commit=False)
    try:
        enqueue_order(conn, "bad id with spaces", 0)
        sys.exit("an invalid aggregate_id was accepted")
    except psycopg.errors.InvalidParameterValue as err:
        if err.diag.column_name != "aggregate_id":
            raise
