-- +goose Up

-- Retry parking at the consumer (inbox.Engine, every transport). When an
-- event's side effect fails and it is to be retried after a delay, its group
-- (= aggregate id) is parked for that consumer: this row names the retrying
-- event (the head) and counts its failures. Until the head settles (applied,
-- or dead-lettered after its last retry) every later event of the group that
-- reaches the consumer waits behind it: on RabbitMQ it goes to the head's
-- delay queue, on JetStream it is held unacknowledged, on SQS the FIFO group
-- keeps it back. Being a row rather than process memory, the park survives a
-- restart, a deploy or a Lambda environment recycle, so a later event can
-- never overtake its retrying predecessor; and the failure count is the
-- event's own, not the broker's delivery count, so redeliveries that were
-- not failures (a database outage, a lost connection) spend no retry budget.
-- The row goes in the transaction that applies or dead-letters the head.
CREATE TABLE inbox_parked (
    consumer    text        NOT NULL,
    group_id    text        NOT NULL,
    -- The head: its event id, or for a message that is not a valid
    -- envelope 'sha256:' || hex of its body.
    message_key text        NOT NULL,
    event_id    uuid,
    sequence    bigint,
    -- The head's failed attempts so far (its own failures only).
    failures    integer     NOT NULL CHECK (failures >= 0),
    -- The retry the head waits for (1-based; RabbitMQ's delay queue), and
    -- when it is due back.
    retry       integer     NOT NULL CHECK (retry >= 0),
    due_at      timestamptz NOT NULL,
    -- After this the head is presumed lost (a purged delay queue) and the
    -- group's later events go ahead (inbox.ParkGrace after due_at).
    expires_at  timestamptz NOT NULL,
    last_error  text,
    parked_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, group_id)
);

GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_parked TO fifobox_consumer;
-- Operations: status (parked groups) and release.
GRANT SELECT, DELETE ON inbox_parked TO fifobox_operations;

-- +goose Down
DROP TABLE inbox_parked;
