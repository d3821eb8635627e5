package capture_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/capture"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/wire"
)

// installed is a producer's schema (its search_path holds nothing else)
// with the profile's document table, captured into fifobox in a schema of
// its own.
type installed struct {
	app, fifobox *pgtest.DB
	prof         *wire.Profile
	inst         capture.Installation
}

func install(t *testing.T, profile, ddl string) installed {
	t.Helper()
	ctx := context.Background()
	fb := pgtest.New(t)
	app := pgtest.NewEmpty(t)
	if _, err := app.Pool.Exec(ctx, ddl); err != nil {
		t.Fatal(err)
	}
	p, err := wire.Load(profile)
	if err != nil {
		t.Fatal(err)
	}
	inst, err := capture.Install(ctx, app.Pool, p, capture.InstallConfig{Schema: fb.Schema})
	if err != nil {
		t.Fatal(err)
	}
	// Installing again replaces the installation.
	if _, err := capture.Install(ctx, app.Pool, p, capture.InstallConfig{Schema: fb.Schema}); err != nil {
		t.Fatalf("second install: %v", err)
	}
	return installed{app: app, fifobox: fb, prof: p, inst: inst}
}

// The producers' own writes, as each document has them, become fifobox
// events: the document's event id (UUID or ULID) as the event id, the
// document's key as the aggregate, numbered in insert order per aggregate;
// and the table's status columns follow the event to sent and dead.
func TestInstallCapturesTheDocumentsWrites(t *testing.T) {
	t.Parallel()
	tests := []struct {
		profile string
		// insert writes three events of aggregate "A" (two in one
		// statement) and one of "B", as the document's producer does.
		insert []string
		// expect lists (event id, aggregate id, type) per row, in insert order.
		expect string
		// sent and dead count the rows whose status says so.
		sent, dead string
	}{
		{"holdco", []string{
			`INSERT INTO event_outbox (id, group_id, subsidiary_id, aggregate_type, aggregate_id, event_type, payload) VALUES
				('00000000-0000-4000-8000-000000000001', '10000000-0000-4000-8000-000000000000', NULL, 'order', 'a0000000-0000-4000-8000-00000000000a', 'created', '{"order_no": "ORD-1"}'),
				('00000000-0000-4000-8000-000000000002', '10000000-0000-4000-8000-000000000000', NULL, 'order', 'a0000000-0000-4000-8000-00000000000a', 'updated', '{"order_no": "ORD-1"}')`,
			`INSERT INTO event_outbox (id, group_id, subsidiary_id, aggregate_type, aggregate_id, event_type, payload) VALUES
				('00000000-0000-4000-8000-000000000003', '10000000-0000-4000-8000-000000000000', '20000000-0000-4000-8000-000000000000', 'order', 'b0000000-0000-4000-8000-00000000000b', 'created', '{}')`,
			`INSERT INTO event_outbox (id, group_id, subsidiary_id, aggregate_type, aggregate_id, event_type, payload) VALUES
				('00000000-0000-4000-8000-000000000004', '10000000-0000-4000-8000-000000000000', NULL, 'order', 'a0000000-0000-4000-8000-00000000000a', 'cancelled', '{}')`},
			`SELECT id::text, aggregate_id::text, event_type FROM event_outbox ORDER BY id`,
			`SELECT count(*) FROM event_outbox WHERE status = 'published'`,
			`SELECT count(*) FROM event_outbox WHERE status = 'dead' AND attempts = 7`},
		{"corebilling", []string{
			`INSERT INTO billing_events (id, subject, tenant_id, resource_id, payload) VALUES
				('01ARZ3NDEKTSV4RRFFQ69G5FA1', 'subscription.created', 'tnt_1', 'sub_A', '{"id": "01ARZ3NDEKTSV4RRFFQ69G5FA1", "data": {"n": 1}, "metadata": {"correlation_id": "c1", "outbox_status": "pending"}}'),
				('01ARZ3NDEKTSV4RRFFQ69G5FA2', 'subscription.trialing', 'tnt_1', 'sub_A', '{"data": {"n": 2}, "metadata": {"outbox_status": "pending"}}')`,
			`INSERT INTO billing_events (id, subject, tenant_id, resource_id, payload) VALUES
				('01ARZ3NDEKTSV4RRFFQ69G5FA3', 'invoice.created', 'tnt_1', NULL, '{"data": {}, "metadata": {"outbox_status": "pending"}}')`,
			`INSERT INTO billing_events (id, subject, tenant_id, resource_id, payload) VALUES
				('01ARZ3NDEKTSV4RRFFQ69G5FA4', 'subscription.active', 'tnt_1', 'sub_A', '{"data": {"n": 3}, "metadata": {"outbox_status": "pending"}}')`},
			`SELECT id, coalesce(resource_id, tenant_id), subject FROM billing_events ORDER BY id`,
			`SELECT count(*) FROM billing_events WHERE payload #>> '{metadata,outbox_status}' = 'dispatched'`,
			`SELECT count(*) FROM billing_events WHERE payload #>> '{metadata,outbox_status}' = 'dead_letter' AND payload #>> '{metadata,outbox_last_error}' = 'boom'`},
		{"corewrite", []string{
			`INSERT INTO outbox (outbox_id, event_type, aggregate_type, aggregate_id, payload) VALUES
				('00000000-0000-4000-8000-000000000001', 'ProductCreated', 'product', 'P1', '{"PRD_ID": "P1"}'),
				('00000000-0000-4000-8000-000000000002', 'ProductUpdated', 'product', 'P1', '{"XPRD02": 10}')`,
			`INSERT INTO outbox (outbox_id, event_type, aggregate_type, aggregate_id, payload) VALUES
				('00000000-0000-4000-8000-000000000003', 'ProductCreated', 'product', 'P2', '{"PRD_ID": "P2"}')`,
			`INSERT INTO outbox (outbox_id, event_type, aggregate_type, aggregate_id, payload) VALUES
				('00000000-0000-4000-8000-000000000004', 'ProductDeleted', 'product', 'P1', '{}')`},
			`SELECT outbox_id::text, aggregate_id, event_type FROM outbox ORDER BY outbox_id`, "", ""},
		{"ticketing", []string{
			`INSERT INTO outbox (id, event_type, aggregate_id, payload, created_at) VALUES
				('00000000-0000-4000-8000-000000000001', 'hold.created', 'a0000000-0000-4000-8000-00000000000a', '{"seats": 2}', now()),
				('00000000-0000-4000-8000-000000000002', 'hold.expired', 'a0000000-0000-4000-8000-00000000000a', '{}', now())`,
			`INSERT INTO outbox (id, event_type, aggregate_id, payload, created_at) VALUES
				('00000000-0000-4000-8000-000000000003', 'order.confirmed', 'b0000000-0000-4000-8000-00000000000b', '{}', now())`,
			`INSERT INTO outbox (id, event_type, aggregate_id, payload, created_at) VALUES
				('00000000-0000-4000-8000-000000000004', 'hold.created', 'a0000000-0000-4000-8000-00000000000a', '{}', now())`},
			`SELECT id::text, aggregate_id::text, event_type FROM outbox ORDER BY id`,
			`SELECT count(*) FROM outbox WHERE published AND published_at IS NOT NULL`, ""},
		{"transfers", []string{
			transfersInsert("tr_A", "00000000-0000-4000-8000-000000000001"),
			transfersInsert("tr_A", "00000000-0000-4000-8000-000000000002"),
			transfersInsert("tr_B", "00000000-0000-4000-8000-000000000003"),
			transfersInsert("tr_A", "00000000-0000-4000-8000-000000000004")},
			`SELECT payload #>> '{envelope,eventId}', payload #>> '{key,transferId}', eventType FROM outbox ORDER BY payload #>> '{envelope,eventId}'`,
			`SELECT count(*) FROM outbox WHERE state = 'SENT' AND attempts = 1`,
			`SELECT count(*) FROM outbox WHERE state = 'FAILED' AND lastError = 'boom' AND attempts = 7`},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			in := install(t, tt.profile, documentTables[tt.profile])
			for _, q := range tt.insert {
				if _, err := in.app.Pool.Exec(ctx, q); err != nil {
					t.Fatalf("the producer's insert: %v", err)
				}
			}
			rows, _ := in.app.Pool.Query(ctx, tt.expect)
			want, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ ID, Agg, Type string }])
			if err != nil {
				t.Fatal(err)
			}
			rows, _ = in.fifobox.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, event_type, aggregate_seq, body FROM outbox ORDER BY event_id`)
			type stored struct {
				ID, Agg, Type string
				Seq           int64
				Body          []byte
			}
			got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[stored])
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(want) || len(got) != 4 {
				t.Fatalf("fifobox holds %d events, the table %d rows, want 4", len(got), len(want))
			}
			for i, w := range want {
				id := w.ID
				if in.prof.EventIDFormat == wire.ULID {
					if id, err = wire.ULID.Stored(w.ID); err != nil {
						t.Fatal(err)
					}
				}
				g := got[i]
				if g.ID != id || g.Agg != w.Agg || g.Type != w.Type {
					t.Errorf("event %d: stored %s %s %s, the row has %s %s %s", i, g.ID, g.Agg, g.Type, id, w.Agg, w.Type)
				}
				// Sequence per aggregate in insert order: ids ascend in insert order here.
				wantSeq := map[int]int64{0: 1, 1: 2, 2: 1, 3: 3}[i]
				if g.Seq != wantSeq {
					t.Errorf("event %d (%s): sequence %d, want %d", i, g.Agg, g.Seq, wantSeq)
				}
				var e envelope.Envelope
				if err := json.Unmarshal(g.Body, &e); err != nil || e.ID != id {
					t.Errorf("event %d: body %s: %v", i, g.Body, err)
				}
				if in.prof.Passthrough() {
					// The body the profile publishes is the document's envelope:
					// read back through the profile's keys, it is the event.
					back, err := in.prof.Envelope(e.Payload)
					if err != nil || back.ID != id || back.AggregateID != w.Agg {
						t.Errorf("event %d: the payload read back through the keys: %+v, %v", i, back, err)
					}
				}
			}
			if tt.sent == "" {
				if in.inst.StatusTrigger != "" {
					t.Errorf("a status trigger without a status section")
				}
				return
			}
			// fifobox's dispatcher publishes them (a broker that takes everything).
			d, err := outbox.NewDispatcher(in.fifobox.Pool, outbox.PublisherFunc(func(_ context.Context, msgs []outbox.Message) []error {
				return make([]error, len(msgs))
			}), outbox.DispatcherConfig{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				t.Fatal(err)
			}
			dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			if err := d.Drain(dctx); err != nil {
				t.Fatal(err)
			}
			var n int
			if err := in.app.Pool.QueryRow(ctx, tt.sent).Scan(&n); err != nil || n != 4 {
				t.Errorf("%d rows say sent, want 4 (%v)", n, err)
			}
			if tt.dead == "" {
				return
			}
			if _, err := in.fifobox.Pool.Exec(ctx, `UPDATE outbox SET state = 'dead', attempts = 7, last_error = 'boom' WHERE event_id = $1`, got[0].ID); err != nil {
				t.Fatal(err)
			}
			if err := in.app.Pool.QueryRow(ctx, tt.dead).Scan(&n); err != nil || n != 1 {
				t.Errorf("%d rows say dead, want 1 (%v)", n, err)
			}
		})
	}
}

// transfersInsert is seeds/004's wire-test insert, as written, with the
// transfer id and event id given.
func transfersInsert(transfer, eventID string) string {
	return fmt.Sprintf(`INSERT INTO outbox (id, eventType, payload)
VALUES (
  gen_random_uuid(),
  'events.transfers.submitted.usdc',
  jsonb_build_object(
    'envelope', jsonb_build_object('v',1,'eventId', '%s', 'occurredAt', now(), 'tenantId','tnt_demo','type','events.transfers.submitted.usdc'),
    'key', jsonb_build_object('transferId','%s'),
    'payload', jsonb_build_object('amount', jsonb_build_object('value','10.00','currency','USD'))
  )
)`, eventID, transfer)
}

// A row fifobox could not deliver fails the producer's own insert, naming
// the field, and nothing of that statement is written: never a silent drop
// at run time.
func TestCaptureRefusesARowLoudly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	in := install(t, "transfers", documentTables["transfers"])
	for _, tt := range []struct{ name, sql, want string }{
		{"no key path", strings.Replace(transfersInsert("tr_1", "00000000-0000-4000-8000-000000000001"), "'key', jsonb_build_object('transferId','tr_1'),", "", 1),
			"aggregate_id"},
		{"no event id", strings.Replace(transfersInsert("tr_1", "x"), "'eventId', 'x', ", "", 1), "has no event id (source.event_id: payload.envelope.eventId)"},
		{"not a UUID", transfersInsert("tr_1", "not-a-uuid"), "id"},
	} {
		_, err := in.app.Pool.Exec(ctx, tt.sql)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: got %v, want an error containing %q", tt.name, err, tt.want)
		}
	}
	var n int
	if err := in.app.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 0 {
		t.Errorf("the table holds %d rows after refused inserts (%v)", n, err)
	}
	// The same event id twice is refused by the index Install made.
	ok := transfersInsert("tr_1", "00000000-0000-4000-8000-000000000009")
	if _, err := in.app.Pool.Exec(ctx, ok); err != nil {
		t.Fatal(err)
	}
	if _, err := in.app.Pool.Exec(ctx, ok); err == nil {
		t.Errorf("a second row with the same event id was accepted")
	}
}

// Installing on a table whose rows already share a json event id, or on a
// schema without fifobox, is refused with the profile field named.
func TestInstallRefusesBadMappings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fb := pgtest.New(t)
	app := pgtest.NewEmpty(t)
	if _, err := app.Pool.Exec(ctx, documentTables["transfers"]); err != nil {
		t.Fatal(err)
	}
	dup := transfersInsert("tr_1", "00000000-0000-4000-8000-000000000001")
	for i := 0; i < 2; i++ {
		if _, err := app.Pool.Exec(ctx, dup); err != nil {
			t.Fatal(err)
		}
	}
	p, err := wire.Load("transfers")
	if err != nil {
		t.Fatal(err)
	}
	_, err = capture.Install(ctx, app.Pool, p, capture.InstallConfig{Schema: fb.Schema})
	if !errors.Is(err, capture.ErrSource) || !strings.Contains(err.Error(), "source.event_id: payload.envelope.eventId: two rows") {
		t.Errorf("duplicate event ids: got %v", err)
	}
	_, err = capture.Install(ctx, app.Pool, p, capture.InstallConfig{Schema: app.Schema})
	if err == nil || !strings.Contains(err.Error(), "no fifobox installation") {
		t.Errorf("no fifobox: got %v", err)
	}
	// A missing key path: the profile names a member the column cannot hold.
	bad, err := wire.Parse([]byte(strings.Replace(mustRead(t, "transfers"), `"aggregate_id": "payload.key.transferId"`, `"aggregate_id": "payload..transferId"`, 1)))
	if err == nil || !strings.Contains(err.Error(), "source.aggregate_id") {
		t.Errorf("empty key path: got %v, %v", bad, err)
	}
}

func mustRead(t *testing.T, name string) string {
	t.Helper()
	p, err := wire.Load(name)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// fifobox in a schema of its own serves producers whose search_path holds
// only their schema, with a table of theirs named outbox: the enqueue
// function called by its qualified name resolves everything in fifobox's
// schema (migration 00052).
func TestEnqueueFromAnotherSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fb := pgtest.New(t)
	app := pgtest.NewEmpty(t)
	if _, err := app.Pool.Exec(ctx, documentTables["transfers"]); err != nil {
		t.Fatal(err)
	}
	q := fmt.Sprintf(`SELECT event_id FROM %s.fifobox_enqueue_batch($1::json)`, pgx.Identifier{fb.Schema}.Sanitize())
	var id string
	if err := app.Pool.QueryRow(ctx, q, `[{"type": "events.transfers.submitted.usdc", "aggregate_type": "transfer", "aggregate_id": "tr_1", "payload": {}}]`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var mine, theirs int
	if err := fb.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE event_id = $1`, id).Scan(&mine); err != nil || mine != 1 {
		t.Errorf("fifobox's outbox holds %d of the event (%v)", mine, err)
	}
	if err := app.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&theirs); err != nil || theirs != 0 {
		t.Errorf("the producer's own outbox holds %d rows (%v)", theirs, err)
	}
}

// Installing as a user who could not keep the status columns true is
// refused before anything is installed, not at the dispatcher's first mark.
func TestInstallChecksTheInstallersRights(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fb := pgtest.New(t)
	app := pgtest.NewEmpty(t)
	if _, err := app.Pool.Exec(ctx, documentTables["ticketing"]); err != nil {
		t.Fatal(err)
	}
	role := "capture_test_" + strings.TrimPrefix(app.Schema, "t_")
	if _, err := app.Pool.Exec(ctx, fmt.Sprintf(`CREATE ROLE %[1]s; GRANT USAGE ON SCHEMA %[2]s, %[3]s TO %[1]s;
		GRANT SELECT ON outbox TO %[1]s; GRANT SELECT ON %[3]s.outbox TO %[1]s`, role, app.Schema, fb.Schema)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = app.Pool.Exec(context.Background(), fmt.Sprintf(`DROP OWNED BY %[1]s; DROP ROLE %[1]s`, role))
	})
	conn, err := pgx.Connect(ctx, app.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SET ROLE "+role); err != nil {
		t.Fatal(err)
	}
	p, err := wire.Load("ticketing")
	if err != nil {
		t.Fatal(err)
	}
	_, err = capture.Install(ctx, conn, p, capture.InstallConfig{Schema: fb.Schema})
	if err == nil || !strings.Contains(err.Error(), "cannot execute "+fb.Schema+".fifobox_enqueue_events (grant it fifobox_producer)") {
		t.Fatalf("without fifobox_producer: got %v", err)
	}
	if _, err := app.Pool.Exec(ctx, "GRANT fifobox_producer TO "+role); err != nil {
		t.Fatal(err)
	}
	_, err = capture.Install(ctx, conn, p, capture.InstallConfig{Schema: fb.Schema})
	if err == nil || !strings.Contains(err.Error(), "source.status: the installing user cannot update") {
		t.Fatalf("without UPDATE on the table: got %v", err)
	}
	var n int
	if err := app.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'fifobox_capture%'
		AND tgrelid IN ('outbox'::regclass, $1::regclass, $2::regclass)`, fb.Schema+".outbox", fb.Schema+".outbox_heads").Scan(&n); err != nil || n != 0 {
		t.Errorf("%d capture triggers after refused installs (%v)", n, err)
	}
}
