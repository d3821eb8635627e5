-- +goose Up

-- Which consumers a database user may act as. Row-level security on the
-- consumer's tables (inbox, inbox_held, inbox_parked) lets a member of
-- fifobox_consumer read and write only the rows of the consumers it is
-- mapped to here, so one consumer's credentials cannot mark another
-- consumer's events applied, release its holds or forge its parks.
--
-- The most specific mapping wins: a user with rows of its own is limited to
-- them; a user without inherits the rows of the roles it is a member of.
-- The default row lets every member of fifobox_consumer act as any
-- consumer ('*'), as before this migration: one shared consumer login
-- (fifobox_consumer_fn) keeps working. To confine a consumer, give its
-- function a login user of its own, a member of fifobox_consumer, and map it:
--   INSERT INTO inbox_consumer_roles (role_name, consumer) VALUES ('orders_projection_fn', 'orders-projection');
-- fifobox_operations sees every consumer's rows (status, prune, release).
-- The owner (migrations) bypasses row-level security, as owners do.
CREATE TABLE inbox_consumer_roles (
    role_name text NOT NULL,
    -- A consumer name, or '*' for every consumer.
    consumer  text NOT NULL,
    PRIMARY KEY (role_name, consumer)
);
INSERT INTO inbox_consumer_roles (role_name, consumer) VALUES ('fifobox_consumer', '*');
GRANT SELECT ON inbox_consumer_roles TO fifobox_consumer, fifobox_operations;

-- The consumers the current user may act as ('*': all). Joined to
-- pg_roles so that a row naming a dropped role is ignored, not an error.
-- +goose StatementBegin
CREATE FUNCTION fifobox_inbox_scope() RETURNS text[] LANGUAGE plpgsql STABLE AS $$
DECLARE
    s text[];
BEGIN
    SELECT array_agg(m.consumer) INTO s FROM inbox_consumer_roles m WHERE m.role_name = current_user;
    IF s IS NULL THEN
        SELECT array_agg(m.consumer) INTO s
        FROM inbox_consumer_roles m JOIN pg_roles r ON r.rolname = m.role_name
        WHERE pg_has_role(current_user, r.oid, 'MEMBER');
    END IF;
    RETURN coalesce(s, '{}');
END
$$;
-- +goose StatementEnd

-- A row is the user's if its scope holds the row's consumer or '*'. The
-- scope is computed once per statement (the scalar subquery), not per row.
-- +goose StatementBegin
DO $rls$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['inbox', 'inbox_held', 'inbox_parked'] LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format($p$CREATE POLICY %I ON %I TO fifobox_consumer
            USING ((SELECT fifobox_inbox_scope()) && ARRAY[consumer, '*'])
            WITH CHECK ((SELECT fifobox_inbox_scope()) && ARRAY[consumer, '*'])$p$,
            t || '_consumer_scope', t);
        EXECUTE format('CREATE POLICY %I ON %I TO fifobox_operations USING (true) WITH CHECK (true)', t || '_operations', t);
    END LOOP;
END
$rls$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $rls$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['inbox', 'inbox_held', 'inbox_parked'] LOOP
        EXECUTE format('DROP POLICY %I ON %I', t || '_consumer_scope', t);
        EXECUTE format('DROP POLICY %I ON %I', t || '_operations', t);
        EXECUTE format('ALTER TABLE %I DISABLE ROW LEVEL SECURITY', t);
    END LOOP;
END
$rls$;
-- +goose StatementEnd
DROP FUNCTION fifobox_inbox_scope();
DROP TABLE inbox_consumer_roles;
