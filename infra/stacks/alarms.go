package stacks

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatch"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatchactions"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambda"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssns"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssnssubscriptions"
	"github.com/aws/jsii-runtime-go"

	"github.com/fifobox/fifobox/pkg/runbook"
)

// Alarm names (after the "<Prefix>-" prefix). Consumer alarms add "-<consumer>".
const (
	AlarmPublishLag        = "OutboxPublishLag"
	AlarmDueBacklog        = "OutboxDueBacklog"
	AlarmPublishRetrying   = "OutboxPublishRetrying"
	AlarmBackingOffEvents  = "OutboxBackingOffEvents"
	AlarmParkedEvents      = "OutboxParkedEvents"
	AlarmStrandedEvents    = "OutboxStrandedEvents"
	AlarmDeadEvents        = "OutboxDeadEvents"
	AlarmParkedAggregates  = "OutboxParkedAggregates"
	AlarmDispatcherErrors  = "DispatcherErrors"
	AlarmDispatcherThrottl = "DispatcherThrottles"
	AlarmScheduleDLQ       = "DispatcherScheduleDLQ"
	AlarmOperationsErrors  = "OperationsErrors"
	AlarmDeliveryFailed    = "TopicDeliveryFailed"
	AlarmDeliveryLost      = "TopicDeliveryLost"
	AlarmConsumerLag       = "ConsumerLag"
	AlarmConsumerFailures  = "ConsumerFailures"
	AlarmConsumerErrors    = "ConsumerErrors"
	AlarmConsumerThrottles = "ConsumerThrottles"
	AlarmQueueAge          = "QueueOldestMessageAge"
	AlarmDLQMessages       = "DLQMessages"
	AlarmSubscriptionDLQ   = "SubscriptionDLQMessages"
	AlarmBrokerQueue       = "BrokerQueueBacklog"
)

// AnnotationNoAlarmSubscriber is the id of the synth warning that the
// alarm topic has no subscriber (no -c alarmEmail).
const AnnotationNoAlarmSubscriber = "fifobox:no-alarm-subscriber"

// brokerQueueMetric is an Amazon MQ for RabbitMQ queue metric (AWS/AmazonMQ,
// dimensions Broker, VirtualHost, Queue), its Maximum over periodMinutes.
func brokerQueueMetric(cfg Config, p *Pipeline, queue, name string, periodMinutes float64) awscloudwatch.Metric {
	return awscloudwatch.NewMetric(&awscloudwatch.MetricProps{
		Namespace: jsii.String("AWS/AmazonMQ"), MetricName: jsii.String(name),
		DimensionsMap: &map[string]*string{
			"Broker": p.BrokerName, "VirtualHost": jsii.String(cfg.AMQP.VirtualHost), "Queue": jsii.String(queue),
		},
		Statistic: jsii.String("Maximum"), Period: awscdk.Duration_Minutes(jsii.Number(periodMinutes)),
	})
}

type alarmSpec struct {
	name, description string
	metric            awscloudwatch.IMetric
	threshold         float64
	periods           float64 // evaluation periods
	datapoints        float64 // breaching datapoints among them that fire the alarm; 0: all
	missing           awscloudwatch.TreatMissingData
	below             bool // fires below the threshold (free memory, free disk)
}

// dispatcherMetric is an EMF gauge the dispatcher emits (dimension Service=dispatcher).
func dispatcherMetric(cfg Config, name, stat string, period float64) awscloudwatch.Metric {
	return awscloudwatch.NewMetric(&awscloudwatch.MetricProps{
		Namespace: jsii.String(cfg.Namespace()), MetricName: jsii.String(name),
		DimensionsMap: &map[string]*string{DimService: jsii.String(ServiceDispatcher)},
		Statistic:     jsii.String(stat), Period: awscdk.Duration_Seconds(jsii.Number(period)),
	})
}

// consumerMetric is an EMF metric a consumer emits (dimension Consumer=<name>).
func consumerMetric(cfg Config, consumer, name, stat string, period float64) awscloudwatch.Metric {
	return awscloudwatch.NewMetric(&awscloudwatch.MetricProps{
		Namespace: jsii.String(cfg.Namespace()), MetricName: jsii.String(name),
		DimensionsMap: &map[string]*string{DimConsumer: jsii.String(consumer)},
		Statistic:     jsii.String(stat), Period: awscdk.Duration_Seconds(jsii.Number(period)),
	})
}

func datapoints(s alarmSpec) float64 {
	if s.datapoints > 0 {
		return s.datapoints
	}
	return s.periods
}

// maximum is an SQS metric's Maximum over periods of the given minutes.
func maximum(metric func(*awscloudwatch.MetricOptions) awscloudwatch.Metric, periodMinutes float64) awscloudwatch.Metric {
	return metric(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum"), Period: awscdk.Duration_Minutes(jsii.Number(periodMinutes))})
}

func minutes(n float64) *awscloudwatch.MetricOptions {
	return &awscloudwatch.MetricOptions{Period: awscdk.Duration_Minutes(jsii.Number(n))}
}

// consumerTexts say, in a consumer's alarm descriptions, what its transport
// does with a failed record, a failed batch and a throttled invocation.
type consumerTexts struct{ failures, batchesFailed, throttled string }

// consumerAlarms are the alarms of every consumer function, whatever feeds
// it: lag, failed records, failed batches, throttles.
func consumerAlarms(cfg Config, n string, fn awslambda.Function, text consumerTexts) []alarmSpec {
	th := cfg.Thresholds
	return []alarmSpec{
		// Consumers emit lag only with the batches they process. One
		// datapoint over 5 minutes fires, so a consumer that sees one late
		// batch an hour alarms too; no batches = no lag (NOT_BREACHING: a
		// stuck consumer shows in its queue's age or backlog alarm).
		{name: AlarmConsumerLag + "-" + n, description: "Consumer " + n + " processed an event later than the threshold after it occurred",
			metric: consumerMetric(cfg, n, MetricConsumerLagSeconds, "Maximum", 300), threshold: th.ConsumerLagSeconds, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		{name: AlarmConsumerFailures + "-" + n, description: "Consumer " + n + " failed records (" + text.failures + ")",
			metric: consumerMetric(cfg, n, MetricFailures, "Sum", 300), threshold: th.ConsumerFailures, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		{name: AlarmConsumerErrors + "-" + n, description: "Consumer function " + n + " failed whole batches" + text.batchesFailed,
			metric: fn.MetricErrors(minutes(5)), threshold: th.ConsumerErrors, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		{name: AlarmConsumerThrottles + "-" + n, description: "Consumer function " + n + " was throttled " + text.throttled,
			metric: fn.MetricThrottles(minutes(5)), threshold: th.ConsumerThrottles, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
	}
}

// newAlarms creates the alarm topic and every alarm; each alarm notifies the
// topic when it fires and when it recovers.
func newAlarms(stack awscdk.Stack, cfg Config, p *Pipeline, net *Network) {
	th := cfg.Thresholds
	// CloudWatch publishes to an encrypted topic only with a CMK whose policy
	// lets it (the form AWS documents for alarm actions; KMS sees the call
	// SNS makes on CloudWatch's behalf, so no source conditions here: the
	// topic policy below restricts who may publish).
	p.TopicKey.AddToResourcePolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
		Sid:        jsii.String("CloudWatchAlarmsPublishToEncryptedTopic"),
		Principals: &[]awsiam.IPrincipal{awsiam.NewServicePrincipal(jsii.String("cloudwatch.amazonaws.com"), nil)},
		Actions:    jsii.Strings("kms:GenerateDataKey", "kms:Decrypt"),
		Resources:  jsii.Strings("*"),
	}), nil)
	p.AlarmTopic = awssns.NewTopic(stack, jsii.String("AlarmTopic"), &awssns.TopicProps{
		DisplayName: jsii.String(cfg.Prefix + " alarms"),
		MasterKey:   p.TopicKey,
		EnforceSSL:  jsii.Bool(true),
	})
	// The topic policy (enforceSSL) replaces SNS's default one: let this
	// account's alarms publish explicitly.
	p.AlarmTopic.AddToResourcePolicy(awsiam.NewPolicyStatement(&awsiam.PolicyStatementProps{
		Sid:        jsii.String("CloudWatchAlarmsPublish"),
		Principals: &[]awsiam.IPrincipal{awsiam.NewServicePrincipal(jsii.String("cloudwatch.amazonaws.com"), nil)},
		Actions:    jsii.Strings("sns:Publish"),
		Resources:  jsii.Strings(*p.AlarmTopic.TopicArn()),
		Conditions: &map[string]any{"StringEquals": map[string]any{"aws:SourceAccount": stack.Account()}},
	}))
	if cfg.AlarmEmail != "" {
		p.AlarmTopic.AddSubscription(awssnssubscriptions.NewEmailSubscription(jsii.String(cfg.AlarmEmail), nil))
	} else {
		// Alarms that notify nobody: say so at every synth.
		awscdk.Annotations_Of(p.AlarmTopic).AddWarningV2(jsii.String(AnnotationNoAlarmSubscriber), jsii.String(
			"the alarm topic has no subscriber, so no alarm reaches anyone: deploy with -c alarmEmail=<address>, or subscribe your paging system to the topic"))
	}

	specs := []alarmSpec{
		// The dispatcher emits its backlog gauges every metrics interval
		// (FIFOBOX_METRICS_INTERVAL, default 10 s) while it runs, and it runs
		// all the time (scheduled every minute, polling until its deadline).
		// Missing data on the two "is publishing keeping up" alarms therefore
		// means the dispatcher is not running or cannot reach the database:
		// BREACHING, so that silence alarms.
		{name: AlarmPublishLag, description: "Events that could be published now wait longer than the threshold (the oldest due event's age; dead, parked and backing-off events excluded), or the dispatcher reports nothing",
			metric: dispatcherMetric(cfg, MetricOldestDueAgeSeconds, "Maximum", 60), threshold: th.PublishLagSeconds, periods: 3, missing: awscloudwatch.TreatMissingData_BREACHING},
		{name: AlarmDueBacklog, description: "More events are due for publishing than the threshold: the dispatcher is not keeping up (or reports nothing)",
			metric: dispatcherMetric(cfg, MetricDueEvents, "Maximum", 60), threshold: th.DueBacklog, periods: 3, missing: awscloudwatch.TreatMissingData_BREACHING},
		// Retryable publish failures (throttling, 5xx, network, KMS, a VPC
		// endpoint) keep retrying for hours (FIFOBOX_RETRY_FOR) instead of
		// going dead: this is the alarm that reports an SNS, KMS or endpoint
		// outage or a lost permission while nothing is lost yet. Five minutes
		// in a row, so a passing throttle does not page anyone. Missing data:
		// keep the state (a silent dispatcher fires the two above).
		{name: AlarmPublishRetrying, description: "Publishing is failing and events are retrying (aggregates whose head waits out a retry backoff) for 5 minutes: the error (SNS, KMS, VPC endpoint, permissions) is in the dispatcher's logs and " + runbook.Text(runbook.PublishRetrying, "") + " (once fixed); the events go dead only after FIFOBOX_RETRY_FOR",
			metric: dispatcherMetric(cfg, MetricRetryingAggregates, "Maximum", 60), threshold: th.RetryingAggregates, periods: 5, missing: awscloudwatch.TreatMissingData_IGNORE},
		{name: AlarmBackingOffEvents, description: "More events than the threshold wait behind aggregates whose head is retrying: the publish failures hold back a large part of the traffic",
			metric: dispatcherMetric(cfg, MetricBackingOffEvents, "Maximum", 60), threshold: th.BackingOffEvents, periods: 5, missing: awscloudwatch.TreatMissingData_IGNORE},
		// Dead and parked counts do not go away when the metric stops: keep the
		// last state (IGNORE); a silent dispatcher is reported by the lag and
		// due-backlog alarms.
		{name: AlarmDeadEvents, description: "Outbox events could not be published (state=dead: a permanent error, or retries exhausted): " + runbook.Text(runbook.DeadEvents, ""),
			metric: dispatcherMetric(cfg, MetricDeadEvents, "Maximum", 300), threshold: th.DeadEvents, periods: 1, missing: awscloudwatch.TreatMissingData_IGNORE},
		{name: AlarmParkedAggregates, description: "Aggregates are held back behind a dead event: their later events are not published until it is requeued",
			metric: dispatcherMetric(cfg, MetricParkedAggregates, "Maximum", 300), threshold: th.ParkedAggregates, periods: 1, missing: awscloudwatch.TreatMissingData_IGNORE},
		{name: AlarmParkedEvents, description: "More events than the threshold are held behind dead events (the dead ones included): the parked part of the backlog keeps growing",
			metric: dispatcherMetric(cfg, MetricParkedEvents, "Maximum", 300), threshold: th.ParkedEvents, periods: 1, missing: awscloudwatch.TreatMissingData_IGNORE},
		// Stranded events are never published by themselves: any is too many.
		{name: AlarmStrandedEvents, description: "Outbox events written around the enqueue path (by the table owner with aggregate_seq set) have been unsent for over 5 minutes and no claim reaches them: they are never published until repaired; " + runbook.Text(runbook.StrandedEvents, "") + " (safe while dispatchers run), then find the writer that bypassed fifobox's enqueue",
			metric: dispatcherMetric(cfg, MetricStrandedEvents, "Maximum", 300), threshold: th.StrandedEvents, periods: 1, missing: awscloudwatch.TreatMissingData_IGNORE},
		// Lambda publishes Errors/Throttles only for invocations that happen; no
		// data = nothing failed (a dispatcher that never runs trips the lag and
		// due-backlog alarms instead): NOT_BREACHING.
		{name: AlarmDispatcherErrors, description: "Dispatcher invocations failed (an error, a timeout or a crash): see the dispatcher function's logs",
			metric: p.Dispatcher.MetricErrors(minutes(5)), threshold: th.DispatcherErrors, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		{name: AlarmDispatcherThrottl, description: "Dispatcher invocations were throttled (reserved concurrency exhausted)",
			metric: p.Dispatcher.MetricThrottles(minutes(5)), threshold: th.DispatcherThrottles, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		// The operations (redrive) function runs the daily prune and operator
		// commands; a failure of either should be looked at.
		{name: AlarmOperationsErrors, description: "Operations function failed (the daily prune, a migration or an operator command): see its logs and " + runbook.Text(runbook.OperationsErrors, ""),
			metric: p.Redrive.MetricErrors(minutes(5)), threshold: th.OperationsErrors, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		// SQS stops publishing metrics of idle queues: missing = empty = fine.
		{name: AlarmScheduleDLQ, description: "EventBridge Scheduler could not invoke the dispatcher or the daily prune",
			metric:    p.ScheduleDLQ.MetricApproximateNumberOfMessagesVisible(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum"), Period: awscdk.Duration_Minutes(jsii.Number(5))}),
			threshold: th.ScheduleDLQVisibleMessages, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
	}
	if p.Topic != nil {
		specs = append(specs,
			// The dispatcher marks an event sent once SNS accepts it; what SNS then
			// fails to deliver to a queue goes to that subscription's DLQ (alarmed
			// per consumer below). SNS publishes these only when it delivers:
			// missing = nothing failed.
			alarmSpec{name: AlarmDeliveryFailed, description: "SNS could not deliver events to a subscribed queue (a disabled key, a changed queue policy, a deleted queue): they are in the subscription DLQs; fix the cause, then for each consumer " + runbook.Text(runbook.SubscriptionDLQMessages, ""),
				metric:    p.Topic.MetricNumberOfNotificationsFailed(&awscloudwatch.MetricOptions{Statistic: jsii.String("Sum"), Period: awscdk.Duration_Minutes(jsii.Number(5))}),
				threshold: th.DeliveryFailures, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmDeliveryLost, description: "SNS could neither deliver events nor move them to the subscription DLQ: those events are lost for that consumer; once the DLQ is reachable, replay them from the outbox: " + runbook.Text(runbook.DeliveryLost, ""),
				metric:    p.Topic.Metric(jsii.String("NumberOfNotificationsFailedToRedriveToDlq"), &awscloudwatch.MetricOptions{Statistic: jsii.String("Sum"), Period: awscdk.Duration_Minutes(jsii.Number(5))}),
				threshold: th.DeliveryLost, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		)
	}
	for _, cr := range p.Consumers {
		n := cr.Consumer.Name
		// A throttled SQS invocation puts its batch back for a visibility
		// timeout and still counts a receive: enough of them dead-letter
		// healthy messages (maxReceiveCount).
		specs = append(specs, consumerAlarms(cfg, n, cr.Function, consumerTexts{
			failures:  "retried by SQS, then dead-lettered",
			throttled: "(account or function concurrency exhausted): its messages wait a visibility timeout and use up receives toward the DLQ",
		})...)
		specs = append(specs,
			// Idle queues emit no SQS metrics: missing = nothing waiting.
			alarmSpec{name: AlarmQueueAge + "-" + n, description: "Queue " + cfg.ResourceName(cr.Consumer.QueueName()) + " holds a message older than the threshold",
				metric:    maximum(cr.Queue.MetricApproximateAgeOfOldestMessage, 1),
				threshold: th.QueueOldestMessageAgeSeconds, periods: 3, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmDLQMessages + "-" + n, description: "Dead-letter queue " + cfg.ResourceName(cr.Consumer.DLQName()) + " holds messages: " + runbook.Text(runbook.DLQMessages, n),
				metric:    maximum(cr.DLQ.MetricApproximateNumberOfMessagesVisible, 5),
				threshold: th.DLQVisibleMessages, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmSubscriptionDLQ + "-" + n, description: "Subscription dead-letter queue " + cfg.ResourceName(cr.Consumer.SubscriptionDLQName()) + " holds events SNS could not deliver to " + n + ": fix the cause (key, queue policy), then " + runbook.Text(runbook.SubscriptionDLQMessages, n),
				metric:    maximum(cr.SubscriptionDLQ.MetricApproximateNumberOfMessagesVisible, 5),
				threshold: th.DLQVisibleMessages, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		)
	}
	for _, bc := range p.BrokerConsumers {
		n := bc.Name
		// A failed invocation makes Lambda's RabbitMQ event source
		// redeliver the whole batch: the inbox drops what was applied, but a
		// function that keeps failing stops the queue.
		specs = append(specs, consumerAlarms(cfg, n, bc.Function, consumerTexts{
			failures:      "sent to its retry queues, then dead-lettered",
			batchesFailed: " (Lambda redelivers them; the queue does not advance while it keeps failing)",
			throttled:     "(account concurrency exhausted): its queue waits",
		})...)
		specs = append(specs,
			// Amazon MQ reports queue figures every minute; missing data means
			// the broker is not reporting, which the other alarms cover.
			alarmSpec{name: AlarmBrokerQueue + "-" + n, description: "RabbitMQ queue " + bc.Queue + " holds more ready messages than the threshold for 5 minutes: consumer " + n + " is not keeping up, or its event source is disabled",
				metric: brokerQueueMetric(cfg, p, bc.Queue, "MessageReadyCount", 1), threshold: th.BrokerQueueReadyMessages, periods: 5, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{name: AlarmDLQMessages + "-" + n, description: "RabbitMQ dead-letter queue " + bc.DLQ + " holds messages: " + runbook.Text(runbook.DLQMessages, n),
				metric: brokerQueueMetric(cfg, p, bc.DLQ, "MessageCount", 5), threshold: th.DLQVisibleMessages, periods: 1, missing: awscloudwatch.TreatMissingData_NOT_BREACHING},
		)
	}
	specs = append(specs, statefulAlarms(stack, cfg, p, net)...)
	action := awscloudwatchactions.NewSnsAction(p.AlarmTopic)
	for _, s := range specs {
		cmp := awscloudwatch.ComparisonOperator_GREATER_THAN_THRESHOLD
		if s.below {
			cmp = awscloudwatch.ComparisonOperator_LESS_THAN_THRESHOLD
		}
		a := awscloudwatch.NewAlarm(stack, jsii.String("Alarm-"+s.name), &awscloudwatch.AlarmProps{
			Metric:             s.metric,
			AlarmName:          jsii.String(cfg.Prefix + "-" + s.name),
			AlarmDescription:   jsii.String(s.description),
			Threshold:          jsii.Number(s.threshold),
			ComparisonOperator: cmp,
			EvaluationPeriods:  jsii.Number(s.periods),
			DatapointsToAlarm:  jsii.Number(datapoints(s)),
			TreatMissingData:   s.missing,
		})
		a.AddAlarmAction(action)
		a.AddOkAction(action)
		p.Alarms = append(p.Alarms, a)
	}
}
