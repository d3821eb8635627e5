-- seeds/003 TR-6: the outbox table, and its index for publisher polling.
CREATE TABLE outbox (
    id           uuid PRIMARY KEY,
    event_type   varchar(100) NOT NULL,
    aggregate_id uuid NOT NULL,
    payload      jsonb NOT NULL,
    published    boolean NOT NULL DEFAULT false,
    created_at   timestamp NOT NULL,
    published_at timestamp
);
CREATE INDEX ON outbox (event_type);
CREATE INDEX ON outbox (published, created_at);
