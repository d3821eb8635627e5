-- +goose Up

-- Strict per-aggregate order at the consumer (inbox.Handler, the default).
-- When a consumer dead-letters a message (invalid, a permanent error, or its
-- last receive failed), the message's group (= aggregate id) is held for that
-- consumer: the message and every later message of the group that reaches
-- the consumer is listed here, in arrival order (position), and sent to the
-- consumer's DLQ behind it. A held group's messages are applied only in
-- position order: when a redriven message is the group's first row it is
-- applied and its row deleted in the same transaction; any other message of
-- a held group goes (back) to the DLQ. The hold ends with its last row.
CREATE TABLE inbox_held (
    consumer    text        NOT NULL,
    group_id    text        NOT NULL,
    position    bigint      GENERATED ALWAYS AS IDENTITY,
    -- The event id, or for a message that is not a valid envelope
    -- 'sha256:' || hex of its body.
    message_key text        NOT NULL,
    event_id    uuid,
    sequence    bigint,
    -- Why the row exists: invalid, permanent, exhausted (its last receive
    -- failed), last-receive (written before a message's last attempt, so a
    -- crash cannot lose the hold), or held (behind the group's first row).
    class       text        NOT NULL,
    held_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, group_id, position),
    UNIQUE (consumer, group_id, message_key)
);

-- +goose Down
DROP TABLE inbox_held;
