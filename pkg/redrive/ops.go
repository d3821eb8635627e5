package redrive

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/migrations"
	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Section states (Status): a section is ok, or says why it could not be
// read; status exits non-zero unless every section is ok (or has nothing
// to read: none).
const (
	StateOK          = string(transport.StateOK)
	StateMissing     = string(transport.StateMissing)
	StateUnreachable = string(transport.StateUnreachable)
	StateError       = string(transport.StateError)
	StateNone        = string(transport.StateNone)
	// StateDegraded is the whole status when a section is not ok.
	StateDegraded = "degraded"
)

// Status is the pipeline's state for operators, in three sections: the
// outbox backlog, why events retry or died, and each consumer's queues.
type Status struct {
	// State is ok when every section is ok (or none), else degraded.
	State  string       `json:"state"`
	Outbox OutboxStatus `json:"outbox"`
	Errors ErrorsStatus `json:"errors"`
	Queues QueuesStatus `json:"queues"`
}

// Section is a status section's health: State is ok, or why it could not
// be read (unreachable, missing, error), with Error saying how.
type Section struct {
	State string `json:"state"`
	Error string `json:"error,omitempty"`
}

// OK reports whether the section's figures are all there.
func (s Section) OK() bool { return s.State == StateOK || s.State == StateNone }

// OutboxStatus is the outbox backlog (outbox.Backlog), ages in seconds.
type OutboxStatus struct {
	Section
	// Pending counts events not yet sent (due, claimed, retrying or parked).
	Pending int64 `json:"pending"`
	// DueEvents counts unsent events that can go now or are in flight.
	DueEvents int64 `json:"due_events"`
	// InFlightAggregates counts aggregates a dispatcher holds right now.
	InFlightAggregates int64 `json:"in_flight_aggregates"`
	// BackingOffEvents and RetryingAggregates: events of aggregates whose
	// head waits out a retry backoff, and those aggregates.
	BackingOffEvents   int64 `json:"backing_off_events"`
	RetryingAggregates int64 `json:"retrying_aggregates"`
	// ParkedEvents and ParkedAggregates: events held behind a dead head
	// (the dead one included), and those aggregates; Dead counts dead events.
	ParkedEvents     int64 `json:"parked_events"`
	ParkedAggregates int64 `json:"parked_aggregates"`
	Dead             int64 `json:"dead"`
	// OldestDueAge is the publish lag: the oldest due event's age.
	OldestDueAge Duration `json:"oldest_due_age_seconds"`
	// OldestPendingAge is the oldest unsent event's age (dead, parked and
	// backing-off ones included).
	OldestPendingAge Duration `json:"oldest_pending_age_seconds"`
	// StrandedEvents: events pending longer than outbox.StrandedAfter that
	// no claim can reach (written around the enqueue path): repair-heads.
	StrandedEvents int64 `json:"stranded_events"`
	// OldestTransactionAge is how long the server's oldest transaction
	// holding back vacuum has been open (any database of the cluster);
	// OldestTransactionPartial: only the migration owner's sessions were
	// visible (see outbox.Backlog).
	OldestTransactionAge     Duration `json:"oldest_transaction_age_seconds"`
	OldestTransactionPartial bool     `json:"oldest_transaction_partial,omitempty"`
}

// QueuesStatus is each consumer's queue figures.
type QueuesStatus struct {
	Section
	// Transport is the transport's kind (sns, rabbitmq, nats).
	Transport string       `json:"transport,omitempty"`
	Consumers []QueueDepth `json:"consumers"`
}

// QueueDepth is one consumer's queue depths (transport.QueueDepth; -1: the
// figure could not be read, its queue's state says why) and its held
// groups (inbox_held).
type QueueDepth struct {
	Consumer string `json:"consumer"`
	// State is the worst of its queues' states.
	State string `json:"state"`
	// Queue is the broker's name for the consumer's queue.
	Queue       string `json:"queue,omitempty"`
	QueueState  string `json:"queue_state"`
	Visible     int64  `json:"visible"`
	InFlight    int64  `json:"in_flight"`
	DLQState    string `json:"dlq_state"`
	DLQ         int64  `json:"dlq"`
	DLQInFlight int64  `json:"dlq_in_flight"`
	// Retrying counts messages waiting out a retry delay (brokers with
	// delay queues, such as RabbitMQ; SQS retries by visibility timeout).
	Retrying int64 `json:"retrying"`
	// SubscriptionDLQ counts messages SNS could not deliver (SNS only:
	// elsewhere its state is none).
	SubscriptionDLQState string `json:"subscription_dlq_state"`
	SubscriptionDLQ      int64  `json:"subscription_dlq"`
	// HeldGroups and HeldMessages count the consumer's groups held in
	// strict order and the messages listed behind their dead ones (-1 when
	// the database could not be read).
	HeldGroups   int64 `json:"held_groups"`
	HeldMessages int64 `json:"held_messages"`
	// ParkedGroups counts groups waiting behind an event the consumer
	// retries after a delay (inbox_parked; -1 when unknown).
	ParkedGroups int64  `json:"parked_groups"`
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
	applied, err := migrations.UpReport(ctx, s.db)
	if err != nil {
		return Result{Operation: cmd.Operation}, err
	}
	if s.cfg.AfterMigrate != nil {
		if err := s.cfg.AfterMigrate(ctx, s.db); err != nil {
			return Result{Operation: cmd.Operation}, fmt.Errorf("migrate: after the migrations: %w", err)
		}
	}
	v, err := migrations.Version(ctx, s.db)
	if err != nil {
		return Result{Operation: cmd.Operation}, err
	}
	id, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return Result{Operation: cmd.Operation}, err
	}
	res := Result{Operation: cmd.Operation, AuditID: id, Affected: int64(len(applied)), Migrations: applied}
	if len(applied) == 0 {
		res.Message = fmt.Sprintf("schema at version %d: nothing to apply", v)
	} else {
		res.Message = fmt.Sprintf("applied %d migrations (%s): schema at version %d", len(applied), strings.Join(applied, ", "), v)
	}
	if s.cfg.Provisioner != nil {
		if err := s.cfg.Provisioner.Provision(ctx); err != nil {
			err = fmt.Errorf("migrate: provision broker topology: %w", err)
			return res, errors.Join(err, s.auditFinish(ctx, id, cmd, res.Affected, err))
		}
		res.Message += "; broker topology provisioned"
	}
	return res, s.auditFinish(ctx, id, cmd, res.Affected, nil)
}

// dbState classifies a database error for status.
func dbState(err error) string {
	if transport.Unreachable(err) {
		return StateUnreachable
	}
	return StateError
}

// status reads its three sections independently: one that cannot be read
// says why in its state and error, and the others are still shown.
func (s *Service) status(ctx context.Context, cmd Command) (Result, error) {
	st := &Status{}
	st.Outbox.Section = s.outboxStatus(ctx, &st.Outbox)
	st.Errors = s.errorClasses(ctx)
	s.queueStatus(ctx, cmd.Consumer, &st.Queues)
	st.State = StateOK
	for _, sec := range []Section{st.Outbox.Section, st.Errors.Section, st.Queues.Section} {
		if !sec.OK() {
			st.State = StateDegraded
		}
	}
	return Result{Operation: cmd.Operation, Status: st}, nil
}

func (s *Service) outboxStatus(ctx context.Context, o *OutboxStatus) Section {
	if s.db == nil {
		return Section{State: dbState(s.cfg.DBError), Error: s.cfg.DBError.Error()}
	}
	b, err := outbox.Stats(ctx, s.db)
	if err != nil {
		return Section{State: dbState(err), Error: err.Error()}
	}
	*o = OutboxStatus{Pending: b.Pending, DueEvents: b.DueEvents, InFlightAggregates: b.InFlight,
		BackingOffEvents: b.BackingOffEvents, RetryingAggregates: b.RetryingAggregates, ParkedEvents: b.ParkedEvents,
		ParkedAggregates: b.ParkedAggregates, Dead: b.Dead, OldestDueAge: Duration(b.OldestDueAge), OldestPendingAge: Duration(b.OldestPendingAge),
		StrandedEvents: b.StrandedEvents, OldestTransactionAge: Duration(b.OldestTransactionAge), OldestTransactionPartial: b.OldestTransactionPartial}
	return Section{State: StateOK}
}

// severity orders states: the worst one names a section.
var severity = map[string]int{StateNone: 0, StateOK: 0, StateMissing: 1, StateError: 2, StateUnreachable: 3}

func worst(states ...string) string {
	w := StateOK
	for _, st := range states {
		if severity[st] > severity[w] {
			w = st
		}
	}
	return w
}

// queueStatus fills each consumer's figures from the transport and its held
// groups from the database.
func (s *Service) queueStatus(ctx context.Context, consumer string, q *QueuesStatus) {
	q.Consumers = []QueueDepth{}
	q.Section = Section{State: StateOK}
	q.Transport = s.cfg.Transport
	var names []string
	if consumer != "" {
		names = []string{consumer}
	}
	if s.cfg.Operations == nil {
		q.Section = Section{State: StateNone, Error: "no transport configured"}
	} else {
		depths, err := s.cfg.Operations.Depths(ctx, names...)
		if err != nil {
			q.Section = Section{State: StateError, Error: fmt.Sprintf("queue depths: %v", err)}
		}
		for _, td := range depths {
			d := QueueDepth{Consumer: td.Consumer, Queue: td.Queue, QueueState: string(td.QueueState), Visible: td.Ready, InFlight: td.InFlight,
				Retrying: td.Retrying, DLQState: string(td.DLQState), DLQ: td.DLQ, DLQInFlight: td.DLQInFlight,
				SubscriptionDLQState: string(td.SubscriptionDLQState), SubscriptionDLQ: td.SubscriptionDLQ, Error: td.Error}
			for _, st := range []*string{&d.QueueState, &d.DLQState, &d.SubscriptionDLQState} {
				if *st == "" { // a transport that does not say: its Error does
					*st = StateOK
					if d.Error != "" {
						*st = StateError
					}
				}
			}
			d.State = worst(d.QueueState, d.DLQState, d.SubscriptionDLQState)
			q.Consumers = append(q.Consumers, d)
		}
	}
	s.held(ctx, consumer, q)
	var bad []string
	for _, d := range q.Consumers {
		if severity[d.State] > 0 {
			bad = append(bad, d.Consumer+" "+d.State)
		}
	}
	if len(bad) > 0 && q.State == StateOK {
		states := make([]string, len(q.Consumers))
		for i, d := range q.Consumers {
			states[i] = d.State
		}
		q.State = worst(states...)
		q.Error = fmt.Sprintf("%d of %d consumers' queues could not be read (%s)", len(bad), len(q.Consumers), strings.Join(bad, ", "))
	}
}

// held fills in each consumer's groups held in strict order, from the
// database (inbox_held), whatever the transport: a consumer holding groups
// that has no queue row (no transport configured, or not among the queues
// reported) gets a row of its own.
func (s *Service) held(ctx context.Context, consumer string, q *QueuesStatus) {
	unknown := func(err error) {
		for i := range q.Consumers {
			q.Consumers[i].HeldGroups, q.Consumers[i].HeldMessages, q.Consumers[i].ParkedGroups = -1, -1, -1
		}
		if q.State == StateOK || q.State == StateNone {
			q.Section = Section{State: dbState(err), Error: "held groups: " + err.Error()}
		}
	}
	if s.db == nil {
		unknown(s.cfg.DBError)
		return
	}
	rows, err := s.db.Query(ctx, sqlHeldByConsumer, consumer)
	if err != nil {
		unknown(err)
		return
	}
	type counts struct{ groups, msgs, parked int64 }
	held := map[string]counts{}
	var order []string
	for rows.Next() {
		var name string
		var c counts
		if err := rows.Scan(&name, &c.groups, &c.msgs, &c.parked); err != nil {
			rows.Close()
			unknown(err)
			return
		}
		held[name] = c
		order = append(order, name)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		unknown(err)
		return
	}
	for i := range q.Consumers {
		c := held[q.Consumers[i].Consumer]
		q.Consumers[i].HeldGroups, q.Consumers[i].HeldMessages, q.Consumers[i].ParkedGroups = c.groups, c.msgs, c.parked
		delete(held, q.Consumers[i].Consumer)
	}
	for _, name := range order {
		if c, ok := held[name]; ok {
			q.Consumers = append(q.Consumers, QueueDepth{Consumer: name, State: StateNone, QueueState: StateNone, DLQState: StateNone,
				SubscriptionDLQState: StateNone, Visible: -1, InFlight: -1, DLQ: -1, DLQInFlight: -1, SubscriptionDLQ: -1,
				HeldGroups: c.groups, HeldMessages: c.msgs, ParkedGroups: c.parked, Error: "holds groups, but the transport reports no queue for this consumer"})
		}
	}
}

func (s *Service) deadList(ctx context.Context, cmd Command) (Result, error) {
	limit := cmd.Limit
	if limit == 0 {
		limit = defaultLimit
	}
	rows, err := s.db.Query(ctx, sqlListDead, cmd.AggregateType, limit)
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
	count := func() (n, m int64, err error) {
		// What outbox.Prune and inbox.Prune delete: sent and discarded
		// events (outbox_events derives sent from the heads; a sent event's
		// age is its creation unless its row says when it was sent), inbox
		// rows, past their retention.
		if err := s.db.QueryRow(ctx, sqlCountPrunableEvents,
			time.Now().Add(-older)).Scan(&n); err != nil {
			return 0, 0, fmt.Errorf("count prunable events: %w", err)
		}
		if err := s.db.QueryRow(ctx, sqlCountPrunableInbox, time.Now().Add(-inboxOlder)).Scan(&m); err != nil {
			return 0, 0, fmt.Errorf("count prunable inbox rows: %w", err)
		}
		return n, m, nil
	}
	olderS, inboxS := FormatDuration(older), FormatDuration(inboxOlder)
	if cmd.DryRun {
		n, m, err := count()
		if err != nil {
			return Result{}, err
		}
		return Result{Operation: cmd.Operation, DryRun: true, Affected: n + m,
			Message: fmt.Sprintf("would delete %d sent events older than %s and %d inbox rows older than %s", n, olderS, m, inboxS)}, nil
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
	// Progress (the CLI) costs a count first; the daily Lambda has none.
	db := progressDB{Pool: s.db}
	if s.cfg.Progress != nil {
		if n, m, err := count(); err == nil {
			var done int64
			total := n + m
			db.deleted = func(k int64) {
				done += k
				s.progress(cmd.Operation, done, total)
			}
		}
	}
	n, err := outbox.Prune(budget, db, older, 5000)
	var m int64
	if err == nil {
		m, err = inbox.Prune(budget, db, inboxOlder, 5000)
	}
	msg := fmt.Sprintf("deleted %d sent events older than %s and %d inbox rows older than %s", n, olderS, m, inboxS)
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

// progressDB is the pool, reporting the rows each statement deleted.
type progressDB struct {
	*pgxpool.Pool
	deleted func(int64)
}

func (p progressDB) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := p.Pool.Exec(ctx, sql, args...)
	if err == nil && p.deleted != nil {
		p.deleted(tag.RowsAffected())
	}
	return tag, err
}

// retention is a prune retention field: def when unset, at least least.
func retention(field string, v Duration, def, least time.Duration) (time.Duration, error) {
	if v == 0 {
		return def, nil
	}
	if d := time.Duration(v); d < least {
		return 0, fieldErr(field, "%s: want at least %s, such as %s", FormatDuration(d), FormatDuration(least), FormatDuration(def))
	}
	return time.Duration(v), nil
}

// selection builds the WHERE clause shared by dead-requeue and replay.
func selection(cmd Command, requireType bool) (ids []string, since, until *time.Time, err error) {
	// Canonical strings, cast to uuid[] in SQL: in QueryExecModeExec (RDS
	// Proxy) pgx cannot infer an array type for []uuid.UUID. Never NULL:
	// cardinality(NULL) would exclude every row.
	ids = []string{}
	for _, s := range cmd.EventIDs {
		u, err := uuid.Parse(s)
		if err != nil {
			return nil, nil, nil, fieldErr("event_ids", "%q: not an event id (%v)", s, err)
		}
		ids = append(ids, u.String())
	}
	if len(ids) == 0 && cmd.AggregateType == "" {
		return nil, nil, nil, fieldErr("event_ids", "select events by event id, or by aggregate type (with since/until)")
	}
	if requireType && cmd.AggregateType == "" {
		return nil, nil, nil, fieldErr("aggregate_type", "required")
	}
	if cmd.Since != nil {
		since = &cmd.Since.Time
	}
	if cmd.Until != nil {
		until = &cmd.Until.Time
	}
	if since != nil && until != nil && !since.Before(*until) {
		return nil, nil, nil, fieldErr("since", "must be before until")
	}
	return ids, since, until, nil
}

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
	if err := s.db.QueryRow(ctx, sqlCountDead,
		ids, cmd.AggregateType, since, until).Scan(&n, &aggs); err != nil {
		return res, fmt.Errorf("%s: count: %w", cmd.Operation, err)
	}
	res.Affected, res.Aggregates = n, aggs
	if cmd.Max > 0 && n > int64(cmd.Max) {
		return res, fmt.Errorf("%s: %w", cmd.Operation, fieldErr("max", "%d dead events selected, more than %d: narrow the selection or raise it", n, cmd.Max))
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
		_, err = tx.Exec(ctx, sqlAuditDone, auditID, res.Affected)
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
