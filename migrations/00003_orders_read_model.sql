-- +goose Up

-- The example consumer's read model (functions/consumer): one row per order,
-- kept current from order events. event_count proves exactly-once: it must
-- equal the number of events applied, whatever was delivered twice.
CREATE TABLE orders_read_model (
    order_id      text        PRIMARY KEY,
    customer_id   text        NOT NULL DEFAULT '',
    amount_cents  bigint      NOT NULL DEFAULT 0,
    currency      text        NOT NULL DEFAULT '',
    status        text        NOT NULL,
    last_sequence bigint      NOT NULL,
    event_count   integer     NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE orders_read_model;
