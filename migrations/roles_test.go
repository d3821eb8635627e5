package migrations_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"testing"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/outbox/outboxtest"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

type nopDLQ struct{}

func (nopDLQ) SendMessage(context.Context, *sqs.SendMessageInput, ...func(*sqs.Options)) (*sqs.SendMessageOutput, error) {
	return &sqs.SendMessageOutput{MessageId: aws.String("m")}, nil
}

// Each function's database role (migration 00011) can do its job, through
// the real code path, and nothing beyond it: every statement outside its
// job fails with insufficient_privilege (42501), and writes nothing.
func TestRolesDoTheirJobAndNothingMore(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		role    string
		job     func(ctx context.Context, t *testing.T, pool *pgxpool.Pool)
		refused []string
	}{
		{role: "fifobox_producer", job: func(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return outbox.Enqueue(ctx, tx, orderEvent("o-new", "order.created", `{"order_id":"o-new","total_cents":100}`))
			}); err != nil {
				t.Fatalf("enqueue: %v", err)
			}
			// The SQL producer path (migrations/00013) needs nothing more.
			var seq int64
			if err := pool.QueryRow(ctx, `SELECT sequence FROM fifobox_enqueue(aggregate_type => 'order', aggregate_id => 'o-new',
				type => 'order.paid', payload => '{"order_id":"o-new"}')`).Scan(&seq); err != nil || seq != 2 {
				t.Fatalf("fifobox_enqueue: sequence %d, %v; want 2", seq, err)
			}
		}, refused: []string{
			`SELECT body FROM outbox`,
			`UPDATE outbox SET state = 'sent'`,
			`DELETE FROM outbox`,
			`UPDATE outbox_heads SET state = 'idle'`,
			`DELETE FROM outbox_wakeups`,
			`INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence) VALUES ('c', gen_random_uuid(), 'order', 'x', 1)`,
			`SELECT * FROM redrive_audit`,
		}},
		{role: "fifobox_dispatcher", job: func(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
			rec := &outboxtest.Recorder{}
			d, err := outbox.NewDispatcher(pool, rec, outbox.DispatcherConfig{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			if err := d.Drain(ctx); err != nil {
				t.Fatalf("drain: %v", err)
			}
			if rec.Len() != 3 {
				t.Fatalf("published %d events, want the 3 pending", rec.Len())
			}
			if _, err := outbox.Stats(ctx, pool); err != nil {
				t.Fatalf("stats: %v", err)
			}
		}, refused: []string{
			`SELECT fifobox_enqueue('order', 'o-x', 'order.paid', '{}')`,
			`DELETE FROM outbox`,
			`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body) VALUES (gen_random_uuid(), 't', 'order', 'x', 1, now(), '\x7b7d')`,
			`UPDATE outbox_aggregates SET last_seq = 0`,
			`DELETE FROM inbox`,
			`INSERT INTO inbox_held (consumer, group_id, message_key, class) VALUES ('c', 'g', 'k', 'held')`,
			`SELECT * FROM orders_read_model`,
			`SELECT * FROM redrive_audit`,
		}},
		{role: "fifobox_consumer", job: func(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
			h, err := sns.NewHandler(pool, nopDLQ{}, readmodel.Apply, sns.HandlerConfig{Consumer: "orders", DLQURL: "dlq", Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			e := orderEvent("o-c", "order.created", `{"order_id":"o-c","total_cents":100}`)
			e.Sequence = 1
			bad := orderEvent("o-bad", "order.created", `{"order_id":"o-bad","total_cents":100}`)
			bad.Sequence = 1
			body, _ := e.Encode()
			for i := 0; i < 2; i++ { // the second delivery is a duplicate
				resp, err := h.Handle(ctx, events.SQSEvent{Records: []events.SQSMessage{
					{MessageId: uuid.NewString(), Body: string(body), Attributes: map[string]string{"MessageGroupId": "o-c"}},
					// Not an envelope: dead-lettered and its group held (inbox_held).
					{MessageId: uuid.NewString(), Body: "{", Attributes: map[string]string{"MessageGroupId": "o-bad"}},
				}})
				if err != nil || len(resp.BatchItemFailures) != 0 {
					t.Fatalf("handle: %+v %v", resp, err)
				}
			}
			var n int
			if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders_read_model) + (SELECT count(*) FROM inbox) + (SELECT count(*) FROM inbox_held)`).Scan(&n); err != nil || n != 3 {
				t.Fatalf("read model + inbox + held rows = %d (%v), want 3", n, err)
			}
		}, refused: []string{
			`SELECT fifobox_enqueue('order', 'o-x', 'order.paid', '{}')`,
			`SELECT * FROM outbox`,
			`UPDATE outbox SET state = 'pending'`,
			`SELECT * FROM outbox_heads`,
			`INSERT INTO outbox_wakeups (aggregate_type, aggregate_id) VALUES ('order', 'x')`,
			`SELECT * FROM redrive_audit`,
		}},
		{role: "fifobox_operations", job: func(ctx context.Context, t *testing.T, pool *pgxpool.Pool) {
			svc, err := redrive.New(pool, redrive.Config{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			for _, cmd := range []redrive.Command{
				{Operation: redrive.OpStatus},
				{Operation: redrive.OpDeadList},
				{Operation: redrive.OpRequeueDead, AggregateType: "order", Actor: "test"},
				{Operation: redrive.OpPrune, Actor: "test"},
				{Operation: redrive.OpReleaseHolds, Consumer: "orders", Actor: "test"},
				{Operation: redrive.OpRepairHeads, Actor: "test"},
			} {
				if _, err := svc.Execute(ctx, cmd); err != nil {
					t.Fatalf("%s: %v", cmd.Operation, err)
				}
			}
			if _, err := outbox.RebuildHeads(ctx, pool); err != nil {
				t.Fatalf("rebuild heads: %v", err)
			}
			// dlq-discard marks what it discarded handled for the consumer (00040).
			if _, err := pool.Exec(ctx, `INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence, outcome)
VALUES ('c', gen_random_uuid(), 'order', 'x', 1, 'discarded')`); err != nil {
				t.Fatalf("mark a discarded event handled: %v", err)
			}
			var dead int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'dead'`).Scan(&dead); err != nil || dead != 0 {
				t.Fatalf("%d dead events after requeue (%v)", dead, err)
			}
		}, refused: []string{
			`SELECT fifobox_enqueue('order', 'o-x', 'order.paid', '{}')`,
			`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body) VALUES (gen_random_uuid(), 't', 'order', 'x', 1, now(), '\x7b7d')`,
			`INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence) VALUES ('c', gen_random_uuid(), 'order', 'x', 1)`,
			`INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence, outcome) VALUES ('c', gen_random_uuid(), 'order', 'x', 1, 'applied')`,
			`UPDATE inbox SET outcome = 'applied'`,
			`UPDATE orders_read_model SET status = 'x'`,
			`DELETE FROM redrive_audit`,
			`UPDATE outbox_aggregates SET last_seq = 0`,
			`DROP TABLE outbox_wakeups`,
		}},
	} {
		t.Run(tc.role, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := context.Background()
			seedForRoles(ctx, t, db)
			if tc.role != "fifobox_producer" { // the functions' own login users
				var member bool
				if err := db.Pool.QueryRow(ctx, `SELECT rolcanlogin AND pg_has_role(rolname, $2, 'MEMBER') FROM pg_roles WHERE rolname = $1`,
					tc.role+"_fn", tc.role).Scan(&member); err != nil || !member {
					t.Fatalf("login user %s_fn: member of %s and can log in: %v (%v)", tc.role, tc.role, member, err)
				}
			}
			pool := loginAs(ctx, t, db, tc.role)
			tc.job(ctx, t, pool)
			for _, q := range tc.refused {
				_, err := pool.Exec(ctx, q)
				var pgErr *pgconn.PgError
				if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
					t.Errorf("%s ran %q: got %v, want insufficient_privilege (42501)", tc.role, q, err)
				}
			}
		})
	}
}

// seedForRoles enqueues three events (one aggregate made dead, for the
// operations' requeue) as the owner.
func seedForRoles(ctx context.Context, t *testing.T, db *pgtest.DB) {
	t.Helper()
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx,
			orderEvent("o-1", "order.created", `{"order_id":"o-1","total_cents":100}`),
			orderEvent("o-1", "order.paid", `{"order_id":"o-1"}`),
			orderEvent("o-2", "order.created", `{"order_id":"o-2","total_cents":100}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, state, created_at)
		VALUES (gen_random_uuid(), 'order.created', 'order', 'o-dead', 1, now(), '\x7b7d', 'dead', now() - interval '2 days')`); err != nil {
		t.Fatal(err)
	}
}

func orderEvent(agg, typ, payload string) envelope.Envelope {
	return envelope.Envelope{ID: uuid.Must(uuid.NewV7()).String(), Type: typ, OccurredAt: time.Now().UTC(),
		AggregateType: "order", AggregateID: agg, SchemaVersion: 1, Payload: json.RawMessage(payload)}
}

// loginAs creates a login user that is a member of role (users are
// cluster-wide: one per test, dropped after it) and connects as it to the
// test's schema.
func loginAs(ctx context.Context, t *testing.T, db *pgtest.DB, role string) *pgxpool.Pool {
	t.Helper()
	user := fmt.Sprintf("%s_%s", db.Schema, role)
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf(`CREATE ROLE %s LOGIN IN ROLE %s`, pgx.Identifier{user}.Sanitize(), pgx.Identifier{role}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(pgtest.WithSearchPath(pgtest.URL(), db.Schema))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(user)
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		_, _ = db.Pool.Exec(context.Background(), fmt.Sprintf(`DROP ROLE IF EXISTS %s`, pgx.Identifier{user}.Sanitize()))
	})
	return pool
}

// The dispatcher reports the server's oldest open transaction, whoever's it
// is (migration 00035's SECURITY DEFINER function), without the right to
// read other sessions in pg_stat_activity (no pg_read_all_stats: it would
// also show every session's query text); producers and consumers cannot
// call the function.
func TestOldestTransactionLeastPrivilege(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	holder, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	tx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the test's held transaction
	var pid int32
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid() FROM (SELECT txid_current()) x").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1200 * time.Millisecond)
	for _, role := range []string{"fifobox_dispatcher", "fifobox_operations"} {
		pool := loginAs(ctx, t, db, role)
		st, err := outbox.Stats(ctx, pool)
		if err != nil {
			t.Fatalf("%s: stats: %v", role, err)
		}
		if st.OldestTransactionAge < 1200*time.Millisecond {
			t.Fatalf("%s: oldest transaction %s; want at least the owner's 1.2 s one", role, st.OldestTransactionAge)
		}
		var start *time.Time
		if err := pool.QueryRow(ctx, "SELECT xact_start FROM pg_stat_activity WHERE pid = $1", pid).Scan(&start); err != nil {
			t.Fatalf("%s: %v", role, err)
		}
		if start != nil {
			t.Fatalf("%s reads another role's sessions in pg_stat_activity: it should not need pg_read_all_stats", role)
		}
	}
	for _, role := range []string{"fifobox_producer", "fifobox_consumer"} {
		pool := loginAs(ctx, t, db, role)
		_, err := pool.Exec(ctx, "SELECT * FROM fifobox_oldest_transaction()")
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s called fifobox_oldest_transaction: %v, want insufficient_privilege", role, err)
		}
	}
}
