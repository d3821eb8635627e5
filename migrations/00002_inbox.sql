-- +goose Up

-- One row per (consumer, event) applied. Inserted in the same transaction as
-- the consumer's side effect: a second delivery finds the row and does
-- nothing. Kept well past the 5-minute SNS/SQS dedup window (inbox.Prune,
-- default 30 days) so redrives and replays are deduplicated too.
CREATE TABLE inbox (
    consumer       text        NOT NULL,
    event_id       uuid        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    sequence       bigint      NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Backs retention (oldest first, bounded batches).
CREATE INDEX inbox_processed_at_idx ON inbox (processed_at);

-- +goose Down
DROP TABLE inbox;
