-- seeds/002: the OUTBOX row its subscribers read (OUTBOX_ID, EVENT_TYPE,
-- AGGREGATE_TYPE, AGGREGATE_ID, PAYLOAD).
CREATE TABLE outbox (
    outbox_id      uuid PRIMARY KEY,
    event_type     text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    payload        jsonb NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
);
