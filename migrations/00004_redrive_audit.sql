-- +goose Up

-- One row per operator action on the pipeline (requeue-dead, replay,
-- dlq-redrive, migrate): who asked, what, when, with which parameters, and how
-- many events or messages it touched. Replay writes its row in the same
-- transaction that deletes the consumer's inbox entries, so every inbox
-- deletion is accounted for.
CREATE TABLE redrive_audit (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation   text        NOT NULL,
    actor       text        NOT NULL,
    request_id  text,
    params      jsonb       NOT NULL DEFAULT '{}',
    dry_run     boolean     NOT NULL DEFAULT false,
    -- started: in progress (or crashed); done; failed (error says why).
    status      text        NOT NULL DEFAULT 'started'
                            CHECK (status IN ('started', 'done', 'failed')),
    affected    bigint      NOT NULL DEFAULT 0,
    error       text,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

CREATE INDEX redrive_audit_started_at_idx ON redrive_audit (started_at);

-- +goose Down
DROP TABLE redrive_audit;
