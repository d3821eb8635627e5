package inbox_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/pkg/inbox"
)

// A consumer moved onto fifobox keeps deduplicating through the inbox table
// its system already has, under that name and shape: an event its
// predecessor recorded there is a duplicate (acknowledged, not applied),
// and every event fifobox applies is recorded there, so the predecessor,
// if it runs again, skips it too. One table per document: seeds/000's
// event_inbox (consumer column), seeds/003's consumed_events (one
// consumer; event_type and consumed_at NOT NULL without defaults) and
// seeds/004's inbox by eventId.
func TestEngineDedupesThroughTheDocumentsInboxTable(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, ddl string
		table     inbox.Table
		// recorded is how the predecessor recorded an event it applied.
		recorded, count string
	}{
		{"holdco event_inbox",
			`CREATE TABLE event_inbox (consumer_name text NOT NULL, event_id uuid NOT NULL, processed_at timestamptz NOT NULL, UNIQUE (consumer_name, event_id))`,
			inbox.Table{Name: "event_inbox", Consumer: "consumer_name", EventID: "event_id", ProcessedAt: "processed_at"},
			`INSERT INTO event_inbox VALUES ('c', $1, now())`,
			`SELECT count(*) FROM event_inbox WHERE consumer_name = 'c' AND processed_at IS NOT NULL`},
		{"ticketing consumed_events",
			`CREATE TABLE consumed_events (event_id uuid PRIMARY KEY, event_type text NOT NULL, consumed_at timestamp NOT NULL)`,
			inbox.Table{Name: "consumed_events", EventID: "event_id", EventType: "event_type", ProcessedAt: "consumed_at"},
			`INSERT INTO consumed_events VALUES ($1, 'thing.happened', now())`,
			`SELECT count(*) FROM consumed_events WHERE event_type = 'thing.happened'`},
		{"transfers inbox by eventId",
			`CREATE TABLE transfers_inbox ("eventId" uuid PRIMARY KEY, "processedAt" timestamptz NOT NULL DEFAULT now())`,
			inbox.Table{Name: "transfers_inbox", EventID: "eventId"},
			`INSERT INTO transfers_inbox ("eventId") VALUES ($1)`,
			`SELECT count(*) FROM transfers_inbox`},
		{"text event ids",
			`CREATE TABLE text_inbox (event_id text PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now())`,
			inbox.Table{Name: "text_inbox", EventID: "event_id"},
			`INSERT INTO text_inbox (event_id) VALUES ($1)`,
			`SELECT count(*) FROM text_inbox`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db := newDB(t)
			if _, err := db.Pool.Exec(ctx, tt.ddl); err != nil {
				t.Fatal(err)
			}
			if err := tt.table.Check(ctx, db.Pool); err != nil {
				t.Fatal(err)
			}
			a1, a2, a3 := ev("A", 1), ev("A", 2), ev("A", 3)
			if _, err := db.Pool.Exec(ctx, tt.recorded, a1.ID); err != nil {
				t.Fatal(err)
			}
			fb := &fakeBroker{}
			spy := &savepointSpy{DB: db.Pool}
			e := newEngine(t, spy, record, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Inbox: tt.table}})
			recs := []*inbox.Record{recordOf(t, "a1", a1), recordOf(t, "a2", a2), recordOf(t, "a3", a3), recordOf(t, "a2-again", a2)}
			if err := e.Handle(ctx, fb, recs); err != nil {
				t.Fatal(err)
			}
			if s := summary(fb.taken()); s != "ack a1; ack a2; ack a3; ack a2-again" {
				t.Errorf("settled: %s", s)
			}
			if got := strings.Join(effectsInOrder(t, db), " "); got != "A/2 A/3" {
				t.Errorf("applied %q, want A/2 A/3 (A/1 was applied by the predecessor)", got)
			}
			var n int
			if err := db.Pool.QueryRow(ctx, tt.count).Scan(&n); err != nil || n != 3 {
				t.Errorf("the document's table records %d events, want 3 (%v)", n, err)
			}
			var own int
			if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox`).Scan(&own); err != nil || own != 0 {
				t.Errorf("fifobox's inbox holds %d rows, want none (%v)", own, err)
			}
			if n := spy.savepoints.Load(); n != 0 {
				t.Errorf("%d savepoints: the batch of first deliveries went the careful way, not the fast way (its claim failed?)", n)
			}
		})
	}
}

// A table that does not fit is refused before the consumer starts, the
// field named: never an ON CONFLICT error at the first event.
func TestInboxTableRefusedBeforeStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := newDB(t)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE event_inbox (consumer_name text NOT NULL, event_id uuid NOT NULL, processed_at timestamptz NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		table inbox.Table
		want  string
	}{
		{inbox.Table{Name: "event_inbox", Consumer: "consumer_name", EventID: "event_id"}, "consumer, event_id: no primary key or unique index on exactly (consumer_name, event_id)"},
		{inbox.Table{Name: "event_inbox", Consumer: "consumer", EventID: "event_id"}, "no column consumer"},
		{inbox.Table{Name: "nope", EventID: "event_id"}, `table "nope": no such table`},
		{inbox.Table{Name: "event_inbox"}, "event_id: required"},
		{inbox.Table{Name: "event_inbox", EventID: "event_id", EventType: "event_id"}, `event_type "event_id": column already used for event_id`},
		{inbox.Table{Name: "a b", EventID: "x"}, `table "a b"`},
	} {
		err := tt.table.Check(ctx, db.Pool)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%+v: got %v, want %q", tt.table, err, tt.want)
		}
	}
	if _, err := inbox.NewEngine(db.Pool, record, inbox.EngineConfig{ConsumerConfig: inbox.ConsumerConfig{Consumer: "c", Inbox: inbox.Table{Name: "x"}}}); err == nil ||
		!strings.Contains(err.Error(), "Inbox: inbox table: event_id: required") {
		t.Errorf("NewEngine: %v", err)
	}
}

// FIFOBOX_INBOX_TABLE is read strictly, errors naming the variable.
func TestInboxTableFromEnv(t *testing.T) {
	t.Setenv(inbox.EnvInboxTable, `{"table": "event_inbox", "consumer": "consumer_name", "event_id": "event_id", "processed": "x"}`)
	if _, err := inbox.TableFromEnv(); err == nil || !strings.Contains(err.Error(), "FIFOBOX_INBOX_TABLE") {
		t.Errorf("unknown field: %v", err)
	}
	t.Setenv(inbox.EnvInboxTable, `{"table": "consumed_events", "event_id": "event_id", "event_type": "event_type", "processed_at": "consumed_at"}`)
	tab, err := inbox.TableFromEnv()
	if err != nil || tab.Name != "consumed_events" || tab.ProcessedAt != "consumed_at" {
		t.Errorf("got %+v, %v", tab, err)
	}
}

// savepointSpy counts the savepoints the engine sets: none when a batch
// goes the fast way.
type savepointSpy struct {
	inbox.DB
	savepoints atomic.Int64
}

func (s *savepointSpy) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := s.DB.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &savepointSpyTx{Tx: tx, s: s}, nil
}

type savepointSpyTx struct {
	pgx.Tx
	s *savepointSpy
}

func (t *savepointSpyTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if strings.HasPrefix(q.SQL, "SAVEPOINT") {
			t.s.savepoints.Add(1)
		}
	}
	return t.Tx.SendBatch(ctx, b)
}
