package redrive

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Status is the pipeline's state for operators: the outbox backlog and each
// consumer's queue and DLQ depth.
type Status struct {
	Backlog outbox.Backlog `json:"backlog"`
	Queues  []QueueDepth   `json:"queues,omitempty"`
}

// QueueDepth is one consumer's queue depths (transport.QueueDepth; -1:
// the broker cannot report it) and its held groups (inbox_held).
type QueueDepth struct {
	Consumer    string `json:"consumer"`
	Visible     int64  `json:"visible"`
	InFlight    int64  `json:"in_flight"`
	DLQ         int64  `json:"dlq"`
	DLQInFlight int64  `json:"dlq_in_flight"`
	// Retrying counts messages waiting out a retry delay (brokers with
	// delay queues, such as RabbitMQ; SQS retries by visibility timeout).
	Retrying int64 `json:"retrying,omitempty"`
	// SubscriptionDLQ counts messages SNS could not deliver (when its URL is known).
	SubscriptionDLQ int64 `json:"subscription_dlq,omitempty"`
	// HeldGroups and HeldMessages count the consumer's groups held in
	// strict order and the messages listed behind their dead ones.
	HeldGroups   int64  `json:"held_groups"`
	HeldMessages int64  `json:"held_messages"`
	Error        string `json:"error,omitempty"`
}

// DeadItem is one dead outbox event (no payload).
type DeadItem struct {
	ID            int64     `json:"id"`
	EventID       string    `json:"event_id"`
	EventType     string    `json:"event_type"`
	AggregateType string    `json:"aggregate_type"`
	AggregateID   string    `json:"aggregate_id"`
	Sequence      int64     `json:"sequence"`
	Attempts      int       `json:"attempts"`
	LastError     string    `json:"last_error"`
	CreatedAt     time.Time `json:"created_at"`
}

func (s *Service) migrate(ctx context.Context, cmd Command) (Result, error) {
	if err := migrations.Up(ctx, s.db); err != nil {
		return Result{}, err
	}
	id, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return Result{}, err
	}
	msg := "migrations applied"
	if s.cfg.Provisioner != nil {
		if err := s.cfg.Provisioner.Provision(ctx); err != nil {
			err = fmt.Errorf("migrate: provision broker topology: %w", err)
			return Result{}, errors.Join(err, s.auditFinish(ctx, id, cmd, 0, err))
		}
		msg += ", broker topology provisioned"
	}
	return Result{Operation: cmd.Operation, AuditID: id, Message: msg}, s.auditFinish(ctx, id, cmd, 0, nil)
}

func (s *Service) status(ctx context.Context, cmd Command) (Result, error) {
	b, err := outbox.Stats(ctx, s.db)
	if err != nil {
		return Result{}, err
	}
	st := &Status{Backlog: b}
	if s.cfg.Operations != nil {
		var names []string
		if cmd.Consumer != "" {
			names = []string{cmd.Consumer}
		}
		depths, err := s.cfg.Operations.Depths(ctx, names...)
		if err != nil {
			return Result{}, fmt.Errorf("status: queue depths: %w", err)
		}
		for _, td := range depths {
			st.Queues = append(st.Queues, QueueDepth{Consumer: td.Consumer, Visible: td.Ready, InFlight: td.InFlight, Retrying: td.Retrying,
				DLQ: td.DLQ, DLQInFlight: td.DLQInFlight, SubscriptionDLQ: td.SubscriptionDLQ, Error: td.Error})
		}
	}
	if err := s.held(ctx, cmd.Consumer, st); err != nil {
		return Result{}, err
	}
	return Result{Operation: cmd.Operation, Status: st}, nil
}

// held fills in each consumer's groups held in strict order, from the
// database (inbox_held), whatever the transport: a consumer holding groups
// that has no queue row (no transport configured, or not among the
// queues reported) gets a row of its own.
func (s *Service) held(ctx context.Context, consumer string, st *Status) error {
	rows, err := s.db.Query(ctx, `SELECT consumer, count(DISTINCT group_id), count(*) FROM inbox_held
WHERE $1 = '' OR consumer = $1 GROUP BY consumer ORDER BY consumer`, consumer)
	if err != nil {
		return fmt.Errorf("status: held groups: %w", err)
	}
	type counts struct{ groups, msgs int64 }
	held := map[string]counts{}
	var order []string
	for rows.Next() {
		var name string
		var c counts
		if err := rows.Scan(&name, &c.groups, &c.msgs); err != nil {
			rows.Close()
			return fmt.Errorf("status: held groups: %w", err)
		}
		held[name] = c
		order = append(order, name)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("status: held groups: %w", err)
	}
	for i := range st.Queues {
		c := held[st.Queues[i].Consumer]
		st.Queues[i].HeldGroups, st.Queues[i].HeldMessages = c.groups, c.msgs
		delete(held, st.Queues[i].Consumer)
	}
	for _, name := range order {
		if c, ok := held[name]; ok {
			st.Queues = append(st.Queues, QueueDepth{Consumer: name, Visible: -1, InFlight: -1, DLQ: -1, DLQInFlight: -1,
				HeldGroups: c.groups, HeldMessages: c.msgs, Error: "no queue figures for this consumer"})
		}
	}
	return nil
}

func (s *Service) deadList(ctx context.Context, cmd Command) (Result, error) {
	limit := cmd.Limit
	if limit <= 0 {
		limit = defaultLimit
	}
	rows, err := s.db.Query(ctx, `SELECT id, event_id::text, event_type, aggregate_type, aggregate_id, aggregate_seq, attempts,
       coalesce(last_error, ''), created_at
FROM outbox WHERE state = 'dead' AND ($1 = '' OR aggregate_type = $1)
ORDER BY id LIMIT $2`, cmd.AggregateType, limit)
	if err != nil {
		return Result{}, fmt.Errorf("list dead events: %w", err)
	}
	items, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadItem, error) {
		var d DeadItem
		err := r.Scan(&d.ID, &d.EventID, &d.EventType, &d.AggregateType, &d.AggregateID, &d.Sequence, &d.Attempts, &d.LastError, &d.CreatedAt)
		return d, err
	})
	if err != nil {
		return Result{}, fmt.Errorf("list dead events: %w", err)
	}
	return Result{Operation: cmd.Operation, Affected: int64(len(items)), Dead: items}, nil
}

// pruneMargin is how long before its invocation's deadline prune stops
// starting batches: it reports what it deleted, and the next run continues.
const pruneMargin = 5 * time.Second

func (s *Service) prune(ctx context.Context, cmd Command) (Result, error) {
	// Validate checked both against their minimums before anything runs.
	older, err := retention("older_than", cmd.OlderThan, defaultPruneAge, MinSentRetention)
	if err != nil {
		return Result{}, err
	}
	inboxOlder, err := retention("inbox_older_than", cmd.InboxOlderThan, inbox.DefaultRetention, MinInboxRetention)
	if err != nil {
		return Result{}, err
	}
	if cmd.DryRun {
		var n, m int64
		if err := s.db.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'sent' AND sent_at < $1`, time.Now().Add(-older)).Scan(&n); err != nil {
			return Result{}, fmt.Errorf("count prunable events: %w", err)
		}
		if err := s.db.QueryRow(ctx, `SELECT count(*) FROM inbox WHERE processed_at < $1`, time.Now().Add(-inboxOlder)).Scan(&m); err != nil {
			return Result{}, fmt.Errorf("count prunable inbox rows: %w", err)
		}
		return Result{Operation: cmd.Operation, DryRun: true, Affected: n + m,
			Message: fmt.Sprintf("would delete %d sent events older than %s and %d inbox rows older than %s", n, older, m, inboxOlder)}, nil
	}
	id, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return Result{}, err
	}
	budget := ctx
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		budget, cancel = context.WithDeadline(ctx, dl.Add(-pruneMargin))
		defer cancel()
	}
	n, err := outbox.Prune(budget, s.db, older, 5000)
	var m int64
	if err == nil {
		m, err = inbox.Prune(budget, s.db, inboxOlder, 5000)
	}
	msg := fmt.Sprintf("deleted %d sent events older than %s and %d inbox rows older than %s", n, older, m, inboxOlder)
	if err != nil && ctx.Err() == nil && budget.Err() != nil {
		// Out of time, not failed: what was deleted stays deleted.
		err = nil
		msg += "; stopped at the invocation's time limit, the next run continues"
	}
	if ferr := s.auditFinish(ctx, id, cmd, n+m, err); err == nil {
		err = ferr
	}
	return Result{Operation: cmd.Operation, AuditID: id, Affected: n + m, Message: msg}, err
}

// retention parses a prune retention field: def when empty, at least least.
func retention(field, v string, def, least time.Duration) (time.Duration, error) {
	if v == "" {
		return def, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < least {
		return 0, fmt.Errorf("%s %q: want a Go duration of at least %s, such as %s", field, v, least, def)
	}
	return d, nil
}

// selection builds the WHERE clause shared by requeue-dead and replay.
func selection(cmd Command, requireType bool) (ids []string, since, until *time.Time, err error) {
	// Canonical strings, cast to uuid[] in SQL: in QueryExecModeExec (RDS
	// Proxy) pgx cannot infer an array type for []uuid.UUID. Never NULL:
	// cardinality(NULL) would exclude every row.
	ids = []string{}
	for _, s := range cmd.EventIDs {
		u, err := uuid.Parse(s)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("event id %q: %w", s, err)
		}
		ids = append(ids, u.String())
	}
	if len(ids) == 0 && cmd.AggregateType == "" {
		return nil, nil, nil, errors.New("select events by event_ids or by aggregate_type (with since/until)")
	}
	if requireType && cmd.AggregateType == "" {
		return nil, nil, nil, errors.New("aggregate_type is required")
	}
	if cmd.Since != nil && cmd.Until != nil && !cmd.Since.Before(*cmd.Until) {
		return nil, nil, nil, errors.New("since must be before until")
	}
	return ids, cmd.Since, cmd.Until, nil
}

const sqlSelectWhere = `
  AND (cardinality($1::uuid[]) = 0 OR event_id = ANY($1::uuid[]))
  AND ($2 = '' OR aggregate_type = $2)
  AND ($3::timestamptz IS NULL OR created_at >= $3)
  AND ($4::timestamptz IS NULL OR created_at < $4)`

func (s *Service) requeueDead(ctx context.Context, cmd Command) (Result, error) {
	return s.changeDead(ctx, cmd, "requeue", "requeued", func(tx pgx.Tx, sel outbox.DeadSelection) (int64, error) {
		return outbox.RequeueDead(ctx, tx, sel)
	})
}

// discardDead gives up on dead events for good (Command.Validate requires
// explicit event ids and a reason).
func (s *Service) discardDead(ctx context.Context, cmd Command) (Result, error) {
	return s.changeDead(ctx, cmd, "discard", "discarded", func(tx pgx.Tx, sel outbox.DeadSelection) (int64, error) {
		return outbox.DiscardDead(ctx, tx, sel, cmd.Reason)
	})
}

// changeDead counts the selected dead events (all a dry run does), then
// applies change in the transaction that writes and finishes the audit row.
func (s *Service) changeDead(ctx context.Context, cmd Command, verb, done string, change func(pgx.Tx, outbox.DeadSelection) (int64, error)) (Result, error) {
	ids, since, until, err := selection(cmd, false)
	if err != nil {
		return Result{}, fmt.Errorf("%s: %w", cmd.Operation, err)
	}
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	var n int64
	var aggs int
	if err := s.db.QueryRow(ctx, `SELECT count(*), count(DISTINCT (aggregate_type, aggregate_id)) FROM outbox WHERE state = 'dead'`+sqlSelectWhere,
		ids, cmd.AggregateType, since, until).Scan(&n, &aggs); err != nil {
		return res, fmt.Errorf("%s: count: %w", cmd.Operation, err)
	}
	res.Affected, res.Aggregates = n, aggs
	if n > int64(cmd.Max) {
		return res, fmt.Errorf("%s: %d dead events selected, more than max %d: narrow the selection or raise max", cmd.Operation, n, cmd.Max)
	}
	if cmd.DryRun {
		res.Message = fmt.Sprintf("would %s %d dead events of %d aggregates", verb, n, aggs)
		return res, nil
	}
	var auditID int64
	err = pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		if auditID, err = s.auditStart(ctx, tx, cmd); err != nil {
			return err
		}
		// Heads are locked before events, in aggregate order, as the
		// dispatcher does: no deadlock with it or a concurrent operation.
		res.Affected, err = change(tx, outbox.DeadSelection{EventIDs: ids, AggregateType: cmd.AggregateType, Since: since, Until: until})
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE redrive_audit SET status = 'done', affected = $2, finished_at = now() WHERE id = $1`, auditID, res.Affected)
		return err
	})
	if err != nil {
		return res, fmt.Errorf("%s: %w", cmd.Operation, err)
	}
	res.AuditID = auditID
	res.Message = fmt.Sprintf("%s %d dead events of %d aggregates", done, res.Affected, aggs)
	s.log.Info("redrive operation finished", "audit_id", auditID, "operation", cmd.Operation, "actor", cmd.Actor, "status", "done", "affected", res.Affected)
	return res, nil
}
