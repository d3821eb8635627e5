-- +goose Up

-- An event an operator discarded from a consumer's dead-letter queue
-- (`fifobox dlq discard`) is handled for that consumer without its side
-- effect: fifobox records it in the inbox with outcome 'discarded', in the
-- transaction that releases its hold (inbox_held), so a later replay or a
-- stray copy finds the claim and is not applied, and the group's remaining
-- events go ahead in order. Rows the consumer writes keep the default,
-- 'applied'; the consumer's claim (pkg/inbox) does not change.
-- A constant default adds the column without rewriting the table; the
-- check is NOT VALID because every existing row has the default (no scan
-- under the table lock), and it holds for every row written from now on.
ALTER TABLE inbox ADD COLUMN outcome text NOT NULL DEFAULT 'applied';
ALTER TABLE inbox ADD CONSTRAINT inbox_outcome_check CHECK (outcome IN ('applied', 'discarded')) NOT VALID;

-- Operations write the discarded rows, and only those: row-level security
-- (00021) lets fifobox_operations act on every consumer's rows, and this
-- restrictive policy keeps its inserts to outcome 'discarded', so the
-- operations role cannot forge a claim that looks applied by a consumer.
-- (Discarding is its job, audited in redrive_audit.)
GRANT INSERT ON inbox TO fifobox_operations;
CREATE POLICY inbox_operations_discard_only ON inbox AS RESTRICTIVE FOR INSERT TO fifobox_operations
    WITH CHECK (outcome = 'discarded');

-- +goose Down
DROP POLICY inbox_operations_discard_only ON inbox;
REVOKE INSERT ON inbox FROM fifobox_operations;
ALTER TABLE inbox DROP CONSTRAINT inbox_outcome_check;
ALTER TABLE inbox DROP COLUMN outcome;
