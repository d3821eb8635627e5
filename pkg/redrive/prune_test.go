package redrive_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// seedRetention writes 3 sent events older than a week, 2 recent ones, an
// old pending and an old dead event (never pruned), and 2 inbox rows older
// than 30 days beside 2 recent ones.
func seedRetention(t *testing.T, db *pgtest.DB) {
	t.Helper()
	for _, sql := range []string{
		`INSERT INTO outbox (event_id, event_type, aggregate_type, aggregate_id, aggregate_seq, occurred_at, body, state, sent_at, created_at)
SELECT gen_random_uuid(), 'order.updated', 'order', 'o-' || g, 1, now(), '\x7b7d', st, sa, now() - interval '9 days'
FROM (VALUES (1, 'sent', now() - interval '8 days'), (2, 'sent', now() - interval '8 days'), (3, 'sent', now() - interval '8 days'),
             (4, 'sent', now() - interval '1 day'), (5, 'sent', now()),
             (6, 'pending', NULL::timestamptz), (7, 'dead', NULL)) v(g, st, sa)`,
		`INSERT INTO inbox (consumer, event_id, aggregate_type, aggregate_id, sequence, processed_at)
SELECT 'c', gen_random_uuid(), 'order', 'o-' || g, 1, now() - make_interval(days => d)
FROM (VALUES (1, 31), (2, 40), (3, 1), (4, 0)) v(g, d)`,
	} {
		if _, err := db.Pool.Exec(context.Background(), sql); err != nil {
			t.Fatal(err)
		}
	}
}

func rowCounts(t *testing.T, db *pgtest.DB) (outbox, inbox int) {
	t.Helper()
	err := db.Pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM inbox)`).Scan(&outbox, &inbox)
	if err != nil {
		t.Fatal(err)
	}
	return outbox, inbox
}

func TestPruneOutboxAndInbox(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name               string
		cmd                string        // the command's JSON, without the operation
		deadline           time.Duration // 0: none
		wantErr            string        // the field named
		wantAffected       int64
		wantOutbox, wantIn int
		wantMessage        string
	}{
		{name: "defaults", wantAffected: 5, wantOutbox: 4, wantIn: 2, wantMessage: "deleted 3 sent events older than 7d and 2 inbox rows older than 30d"},
		{name: "dry run", cmd: `{"dry_run": true}`, wantAffected: 5, wantOutbox: 7, wantIn: 4, wantMessage: "would delete 3"},
		{name: "shortest retentions", cmd: `{"older_than": "25h", "inbox_older_than": "360h"}`, wantAffected: 5, wantOutbox: 4, wantIn: 2},
		{name: "bad outbox retention", cmd: `{"older_than": "a week"}`, wantErr: "older_than", wantOutbox: 7, wantIn: 4},
		// older_than 0 would delete every sent event at once.
		{name: "outbox retention zero", cmd: `{"older_than": "0s"}`, wantErr: "older_than", wantOutbox: 7, wantIn: 4},
		{name: "outbox retention below a day", cmd: `{"older_than": "23h59m"}`, wantErr: "older_than", wantOutbox: 7, wantIn: 4},
		{name: "outbox retention zero, dry run", cmd: `{"older_than": "0s", "dry_run": true}`, wantErr: "older_than", wantOutbox: 7, wantIn: 4},
		{name: "inbox retention inside the dedup window", cmd: `{"inbox_older_than": "5m"}`, wantErr: "inbox_older_than", wantOutbox: 7, wantIn: 4},
		// A redriven message must still find its inbox row: the inbox
		// outlasts the DLQs' 14 days, for an invoked command as for the schedule.
		{name: "inbox retention within the DLQs' 14 days", cmd: `{"inbox_older_than": "336h"}`, wantErr: "inbox_older_than", wantOutbox: 7, wantIn: 4},
		// Less time left than the margin: prune stops before its first batch
		// and reports it, rather than failing.
		{name: "out of time", deadline: 2 * time.Second, wantAffected: 0, wantOutbox: 7, wantIn: 4, wantMessage: "stopped at the invocation's time limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			seedRetention(t, db)
			svc, err := redrive.New(db.Pool, redrive.Config{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if tc.deadline > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.deadline)
				defer cancel()
			}
			payload := tc.cmd
			if payload == "" {
				payload = "{}"
			}
			var res redrive.Result
			cmd, err := redrive.DecodeCommand([]byte(payload), redrive.OpPrune)
			if err == nil {
				cmd.Actor = "test"
				res, err = svc.Execute(ctx, cmd)
			}
			switch {
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tc.wantErr)
			case tc.wantErr == "" && err != nil:
				t.Fatalf("prune: %v", err)
			}
			if tc.wantErr == "" && (res.Affected != tc.wantAffected || !strings.Contains(res.Message, tc.wantMessage)) {
				t.Errorf("result %+v, want %d affected and a message with %q", res, tc.wantAffected, tc.wantMessage)
			}
			if o, i := rowCounts(t, db); o != tc.wantOutbox || i != tc.wantIn {
				t.Errorf("left %d outbox and %d inbox rows, want %d and %d", o, i, tc.wantOutbox, tc.wantIn)
			}
		})
	}
}
