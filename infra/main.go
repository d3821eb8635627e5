package main

import (
	"github.com/aws/aws-cdk-go/awscdk/v2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsec2"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsrds"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssns"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssqs"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambda"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslambdaeventsources"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatch"
	"github.com/aws/aws-cdk-go/awscdk/v2/awscloudwatchactions"
	"github.com/aws/aws-cdk-go/awscdk/v2/awskms"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsiam"
	"github.com/aws/aws-cdk-go/awscdk/v2/awslogs"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsscheduler"
	"github.com/aws/aws-cdk-go/awscdk/v2/awsschedulertargets"
	"github.com/aws/aws-cdk-go/awscdk/v2/triggers"
	"github.com/aws/aws-cdk-go/awscdk/v2/assertions"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssnssubscriptions"
	"github.com/aws/aws-cdk-go/awscdk/v2/awssecretsmanager"
	"github.com/aws/jsii-runtime-go"
	"github.com/aws/constructs-go/constructs/v10"
	"github.com/cdklabs/cdk-nag-go/cdknag/v2"
	"github.com/fifobox/fifobox/pkg/topology"
)

var _ = []any{awsec2.NewVpc, awsrds.NewDatabaseCluster, awssns.NewTopic, awssqs.NewQueue, awslambda.NewFunction, awslambdaeventsources.NewSqsEventSource, awscloudwatch.NewAlarm, awscloudwatchactions.NewSnsAction, awskms.NewKey, awsiam.NewRole, awslogs.NewLogGroup, awsscheduler.NewSchedule, awsschedulertargets.NewLambdaInvoke, triggers.NewTrigger, assertions.Template_FromStack, awssnssubscriptions.NewSqsSubscription, awssecretsmanager.NewSecret, constructs.NewConstruct, cdknag.NewAwsSolutionsChecks, topology.Default}

func main() {
	app := awscdk.NewApp(nil)
	app.Synth(nil)
	jsii.Close()
}
