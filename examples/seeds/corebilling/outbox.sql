-- seeds/001 "DB Schema": billing_events, ULID ids, the outbox metadata
-- (outbox_status, outbox_retry_count, ...) inside the JSON payload.
CREATE TABLE billing_events (
    id          text PRIMARY KEY,
    subject     text NOT NULL,
    tenant_id   text NOT NULL,
    resource_id text,
    payload     jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
