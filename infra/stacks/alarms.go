package stacks

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatch"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatchactions"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssns"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssnssubscriptions"
	"github.com/aws/jsii-runtime-go"
)

// Alarm names (after the "<Prefix>-" prefix). Consumer alarms add "-<consumer>".
const (
	AlarmOldestPendingAge  = "OutboxOldestPendingAge"
	AlarmOutboxBacklog     = "OutboxBacklog"
	AlarmDeadEvents        = "OutboxDeadEvents"
	AlarmParkedAggregates  = "OutboxParkedAggregates"
	AlarmDispatcherErrors  = "DispatcherErrors"
	AlarmDispatcherThrottl = "DispatcherThrottles"
	AlarmScheduleDLQ       = "DispatcherScheduleDLQ"
	AlarmOperationsErrors  = "OperationsErrors"
	AlarmConsumerLag       = "ConsumerLag"
	AlarmConsumerFailures  = "ConsumerFailures"
	AlarmConsumerErrors    = "ConsumerErrors"
	AlarmQueueAge          = "QueueOldestMessageAge"
	AlarmDLQMessages       = "DLQMessages"
)

type alarmSpec struct {
	name, description string
	metric            awscloudwatch.IMetric
	threshold         float64
	periods           float64 // evaluation periods; all must breach
	missing           awscloudwatch.TreatMissingData
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

func minutes(n float64) *awscloudwatch.MetricOptions {
	return &awscloudwatch.MetricOptions{Period: awscdk.Duration_Minutes(jsii.Number(n))}
}

// newAlarms creates the alarm topic and every alarm; each alarm notifies the
// topic when it fires and when it recovers.
func newAlarms(stack awscdk.Stack, cfg Config, p *Pipeline) {
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
	}

	specs := []alarmSpec{
		// The dispatcher emits these gauges every few seconds while it runs, and
		// it runs all the time (scheduled every minute, polling until its
		// deadline). Missing data therefore means the dispatcher is not running
		// or cannot reach the database: BREACHING, so that silence alarms.
		{AlarmOldestPendingAge, "Oldest unsent outbox event is older than the threshold (or the dispatcher reports nothing)",
			dispatcherMetric(cfg, MetricOldestPendingAgeSeconds, "Maximum", 60), th.OldestPendingAgeSeconds, 3, awscloudwatch.TreatMissingData_BREACHING},
		{AlarmOutboxBacklog, "Pending outbox events above the threshold (or the dispatcher reports nothing)",
			dispatcherMetric(cfg, MetricOutboxBacklog, "Maximum", 60), th.OutboxBacklog, 3, awscloudwatch.TreatMissingData_BREACHING},
		// Dead and parked counts do not go away when the metric stops: keep the
		// last state (IGNORE); a silent dispatcher is reported by the two above.
		{AlarmDeadEvents, "Outbox events exhausted their publish attempts (state=dead): inspect with `fifobox dead-list`",
			dispatcherMetric(cfg, MetricDeadEvents, "Maximum", 300), th.DeadEvents, 1, awscloudwatch.TreatMissingData_IGNORE},
		{AlarmParkedAggregates, "Aggregates are held back behind a dead event: later events of the aggregate are not published",
			dispatcherMetric(cfg, MetricParkedAggregates, "Maximum", 300), th.ParkedAggregates, 1, awscloudwatch.TreatMissingData_IGNORE},
		// Lambda publishes Errors/Throttles only for invocations that happen; no
		// data = nothing failed (a dispatcher that never runs trips the backlog
		// and age alarms instead): NOT_BREACHING.
		{AlarmDispatcherErrors, "Dispatcher invocations failed",
			p.Dispatcher.MetricErrors(minutes(5)), th.DispatcherErrors, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
		{AlarmDispatcherThrottl, "Dispatcher invocations were throttled (reserved concurrency exhausted)",
			p.Dispatcher.MetricThrottles(minutes(5)), th.DispatcherThrottles, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
		// SQS stops publishing metrics of idle queues: missing = empty = fine.
		// The operations (redrive) function runs the daily prune and operator
		// commands; a failure of either should be looked at.
		{AlarmOperationsErrors, "Operations function failed (the daily prune, a migration or an operator command): see its logs and the redrive_audit table",
			p.Redrive.MetricErrors(minutes(5)), th.OperationsErrors, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
		{AlarmScheduleDLQ, "EventBridge Scheduler could not invoke the dispatcher or the daily prune",
			p.ScheduleDLQ.MetricApproximateNumberOfMessagesVisible(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum"), Period: awscdk.Duration_Minutes(jsii.Number(5))}),
			th.ScheduleDLQVisibleMessages, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
	}
	for _, cr := range p.Consumers {
		n := cr.Consumer.Name
		specs = append(specs,
			// Consumers emit only when they receive messages: an idle consumer
			// has no lag. A stuck one shows in the queue age alarm.
			alarmSpec{AlarmConsumerLag + "-" + n, "Consumer " + n + " processes events later than the threshold after they occurred",
				consumerMetric(cfg, n, MetricConsumerLagSeconds, "Maximum", 60), th.ConsumerLagSeconds, 3, awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{AlarmConsumerFailures + "-" + n, "Consumer " + n + " failed records (retried by SQS, then dead-lettered)",
				consumerMetric(cfg, n, MetricFailures, "Sum", 300), th.ConsumerFailures, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{AlarmConsumerErrors + "-" + n, "Consumer function " + n + " failed whole batches",
				cr.Function.MetricErrors(minutes(5)), th.ConsumerErrors, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
			// Idle queues emit no SQS metrics: missing = nothing waiting.
			alarmSpec{AlarmQueueAge + "-" + n, "Queue " + cfg.ResourceName(cr.Consumer.QueueName()) + " holds a message older than the threshold",
				cr.Queue.MetricApproximateAgeOfOldestMessage(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum"), Period: awscdk.Duration_Minutes(jsii.Number(1))}),
				th.QueueOldestMessageAgeSeconds, 3, awscloudwatch.TreatMissingData_NOT_BREACHING},
			alarmSpec{AlarmDLQMessages + "-" + n, "Dead-letter queue " + cfg.ResourceName(cr.Consumer.DLQName()) + " holds messages: inspect, then redrive with `fifobox dlq-redrive`",
				cr.DLQ.MetricApproximateNumberOfMessagesVisible(&awscloudwatch.MetricOptions{Statistic: jsii.String("Maximum"), Period: awscdk.Duration_Minutes(jsii.Number(5))}),
				th.DLQVisibleMessages, 1, awscloudwatch.TreatMissingData_NOT_BREACHING},
		)
	}

	action := awscloudwatchactions.NewSnsAction(p.AlarmTopic)
	for _, s := range specs {
		a := awscloudwatch.NewAlarm(stack, jsii.String("Alarm-"+s.name), &awscloudwatch.AlarmProps{
			Metric:             s.metric,
			AlarmName:          jsii.String(cfg.Prefix + "-" + s.name),
			AlarmDescription:   jsii.String(s.description),
			Threshold:          jsii.Number(s.threshold),
			ComparisonOperator: awscloudwatch.ComparisonOperator_GREATER_THAN_THRESHOLD,
			EvaluationPeriods:  jsii.Number(s.periods),
			DatapointsToAlarm:  jsii.Number(s.periods),
			TreatMissingData:   s.missing,
		})
		a.AddAlarmAction(action)
		a.AddOkAction(action)
		p.Alarms = append(p.Alarms, a)
	}
}
